"""The serving engine's busy loop: an `EngineCore` driven by messages, wherever it runs (a thread
of the server's process, or a process of its own: `distengine.core_client`). The messages are
`distengine.engine_messages`'. Commands are applied between steps: a request that arrives while a
step runs joins the next one.
"""
from __future__ import annotations

import queue
import time
from collections.abc import Callable

from distengine.engine_core import EngineCore
from distengine.engine_messages import (AbortRequest, AddRequest, EngineCommand, EngineDied, EngineEvent,
                                        FinishRequest, IdleStats, Refused, Reply, Shutdown, StepOutputs,
                                        UtilityCall)


def _check_health(core: EngineCore) -> None:
    core.executor.check_health()


def _collective_rpc(core: EngineCore, method, args: tuple = (), ranks: list[int] | None = None) -> list:
    return core.executor.collective_rpc(method, args, ranks)


def _is_idle(core: EngineCore) -> bool:
    """Nothing to run, nothing in flight, and every block back in the pool."""
    sched = core.scheduler
    return not sched.has_unfinished() and not sched.has_in_flight() and sched.manager.usage == 0


# What a front end may call on the engine where it runs, between two steps.
UTILITIES: dict[str, Callable] = {"check_health": _check_health, "collective_rpc": _collective_rpc,
                                  "is_idle": _is_idle}


class EngineLoop:
    """`health_interval_s`: while idle, every rank must answer a ping this often (within
    `health_timeout_s`): a worker that died between requests ends the engine now, not at the next
    request. While busy, a step notices it."""

    def __init__(self, core: EngineCore, inbox: queue.SimpleQueue, emit: Callable[[EngineEvent], None],
                 idle_report_s: float = 0.05, health_interval_s: float = 1.0, health_timeout_s: float = 5.0) -> None:
        self.core = core
        self.inbox = inbox
        self.emit = emit
        self.idle_report_s = idle_report_s  # so that the front end's stats line goes on while idle
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s

    def run(self) -> None:
        """Until `Shutdown`; an error of the engine is emitted as `EngineDied`. The caller shuts
        the core down."""
        core, sched = self.core, self.core.scheduler
        busy = False
        checked = time.monotonic()
        try:
            while True:
                while True:  # every command that is there; wait for one only while idle
                    try:
                        cmd = self.inbox.get_nowait() if busy else self.inbox.get(timeout=self.idle_report_s)
                    except queue.Empty:
                        if not busy:
                            self.emit(IdleStats(sched.stats()))
                            if time.monotonic() - checked >= self.health_interval_s:
                                core.executor.check_health(self.health_timeout_s)
                                checked = time.monotonic()
                        break
                    if isinstance(cmd, Shutdown):
                        return
                    self._apply(cmd)
                    busy = sched.has_unfinished() or sched.has_in_flight()
                if not busy:
                    continue
                updates = core.step()
                busy = sched.has_unfinished() or sched.has_in_flight()
                if updates:
                    self.emit(StepOutputs.of(updates, sched.stats()))
                if not busy:
                    self.emit(IdleStats(sched.stats()))
        except BaseException as e:  # noqa: BLE001 - whoever waits on the engine must hear it
            self.emit(EngineDied(e))

    def _apply(self, cmd: EngineCommand) -> None:
        if isinstance(cmd, AddRequest):
            try:
                self.core.add_request(cmd.request)
            except (ValueError, TypeError) as e:  # e.g. a request id already in use
                self.emit(Refused(cmd.request.request_id, e))
        elif isinstance(cmd, AbortRequest):
            self.core.abort([cmd.request_id])
        elif isinstance(cmd, FinishRequest):
            self.core.finish_request(cmd.request_id, "stop", cmd.stop_reason)
        elif isinstance(cmd, UtilityCall):
            try:
                value = UTILITIES[cmd.method](self.core, *cmd.args)
            except Exception as e:  # noqa: BLE001 - the caller gets it, the engine goes on
                self.emit(Reply(cmd.call_id, e))
            else:
                self.emit(Reply(cmd.call_id, None, value))
        else:
            raise ValueError(f"unknown engine command {cmd!r}")
