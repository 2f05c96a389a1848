"""The serving engine's busy loop: an `EngineCore` driven by messages, wherever it runs (a thread
of the server's process, or a process of its own: `distengine.core_client`).

In: `("add", EngineRequest)`, `("abort", request_id)`, `("finish", request_id, stop_string)` (a
stop string the front end found), `("call", call_id, method, args)` (one of `UTILITIES`),
`("shutdown",)`. Out, through `emit`: `("out", updates, stats)` after each step, `("stats", stats)`
when the engine falls idle and every `idle_report_s` while it is, `("refused", request_id, error)`,
`("reply", call_id, error, value)`, and `("dead", error)` as the last message when the engine
failed. Commands are applied between steps: a request that arrives while a step runs joins the
next one.
"""
from __future__ import annotations

import queue
from collections.abc import Callable

from distengine.engine_core import EngineCore
from distengine.scheduler import RequestUpdate


def _check_health(core: EngineCore) -> None:
    core.executor.check_health()


def _collective_rpc(core: EngineCore, method: str, args: tuple = (), ranks: list[int] | None = None) -> list:
    return core.executor.collective_rpc(method, args, ranks)


def _is_idle(core: EngineCore) -> bool:
    """Nothing to run, nothing in flight, and every block back in the pool."""
    sched = core.scheduler
    return not sched.has_unfinished() and not sched.has_in_flight() and sched.manager.usage == 0


# What a front end may call on the engine where it runs, between two steps.
UTILITIES: dict[str, Callable] = {"check_health": _check_health, "collective_rpc": _collective_rpc,
                                  "is_idle": _is_idle}


def pack_updates(updates: list[RequestUpdate]) -> list[tuple]:
    """A step's updates as plain tuples: a quarter of the pickling time of the dataclasses."""
    return [(u.req_id, u.token_id, u.logprobs, u.finish_reason, u.stop_reason, u.num_cached_tokens)
            for u in updates]


def unpack_updates(rows: list[tuple]) -> list[RequestUpdate]:
    return [RequestUpdate(*r) for r in rows]


class EngineLoop:
    def __init__(self, core: EngineCore, inbox: queue.SimpleQueue, emit: Callable[[tuple], None],
                 idle_report_s: float = 0.05) -> None:
        self.core = core
        self.inbox = inbox
        self.emit = emit
        self.idle_report_s = idle_report_s  # so that the front end's stats line goes on while idle

    def run(self) -> None:
        """Until `("shutdown",)`; an error of the engine is emitted as `("dead", error)`. The
        caller shuts the core down."""
        core, sched = self.core, self.core.scheduler
        busy = False
        try:
            while True:
                while True:  # every command that is there; wait for one only while idle
                    try:
                        cmd = self.inbox.get_nowait() if busy else self.inbox.get(timeout=self.idle_report_s)
                    except queue.Empty:
                        if not busy:
                            self.emit(("stats", sched.stats()))
                        break
                    if cmd[0] == "shutdown":
                        return
                    self._apply(cmd)
                    busy = sched.has_unfinished() or sched.has_in_flight()
                if not busy:
                    continue
                updates = core.step()
                busy = sched.has_unfinished() or sched.has_in_flight()
                if updates:
                    self.emit(("out", pack_updates(updates), sched.stats()))
                if not busy:
                    self.emit(("stats", sched.stats()))
        except BaseException as e:  # noqa: BLE001 - whoever waits on the engine must hear it
            self.emit(("dead", e))

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            req = cmd[1]
            try:
                self.core.add_request(req)
            except (ValueError, TypeError) as e:  # e.g. a request id already in use
                self.emit(("refused", req.request_id, e))
        elif kind == "abort":
            self.core.abort([cmd[1]])
        elif kind == "finish":
            self.core.finish_request(cmd[1], "stop", cmd[2])
        elif kind == "call":
            _, call_id, method, args = cmd
            try:
                value = UTILITIES[method](self.core, *args)
            except Exception as e:  # noqa: BLE001 - the caller gets it, the engine goes on
                self.emit(("reply", call_id, e, None))
            else:
                self.emit(("reply", call_id, None, value))
        else:
            raise ValueError(f"unknown engine command {kind!r}")
