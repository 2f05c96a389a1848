"""Where a serving engine's loop runs, seen from its front end (`AsyncLLM`): in a thread of this
process (`ThreadEngineClient`), or in a process of its own (`ProcessEngineClient`, the default:
vLLM's engine-core process). Both take the loop's commands (`distengine.engine_messages`) through
`send` and hand every event the loop emits to `on_message` (from the loop's thread, or from the
thread that reads the process's messages); `call` runs one of the loop's utilities between two steps.

Why a process: the front end (HTTP, detokenization, streaming to hundreds of clients) is Python
work, and in one process it shares the interpreter lock with the loop that launches the steps.
In a process of its own, the engine never waits for the front end, and the front end's work
on step N's outputs overlaps step N+1.

The process is `python -m distengine.core_client FD` with one end of a socket pair: messages are
pickled both ways. It ignores Ctrl-C (the front end shuts it down), and it shuts its engine down
and exits when the front end's end closes (the front end died) or on SIGTERM.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from distengine.config import EngineConfig
from distengine.engine_messages import (EngineCommand, EngineDied, EngineEvent, Ready, Reply, Shutdown, StartFailed,
                                        UtilityCall)
from distengine.executor import PROJECT_ROOT, EngineDeadError

if TYPE_CHECKING:
    from distengine.engine_core import EngineInfo


class EngineClient:
    """What the front end holds: `info` (the engine's `EngineInfo`), `send(command)`,
    `call(method, *args) -> Future`, `shutdown()`."""

    info: EngineInfo

    def __init__(self, on_message: Callable[[EngineEvent], None]) -> None:
        self._on_message = on_message
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._calls_lock = threading.Lock()  # a call is either answered or failed with the engine
        self._dead: BaseException | None = None

    def send(self, command: EngineCommand) -> None:
        raise NotImplementedError

    def call(self, method: str, *args) -> Future:
        """The utility's result, or its error, in a future (EngineDeadError once the engine is gone)."""
        fut: Future = Future()
        with self._calls_lock:
            if self._dead is not None:
                fut.set_exception(self._dead)
                return fut
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
        self.send(UtilityCall(call_id, method, args))
        return fut

    def shutdown(self) -> None:
        raise NotImplementedError

    def _dispatch(self, msg: EngineEvent) -> None:
        if isinstance(msg, Reply):
            with self._calls_lock:
                fut = self._calls.pop(msg.call_id, None)
            if fut is None:
                return
            if msg.error is not None:
                fut.set_exception(msg.error)
            else:
                fut.set_result(msg.value)
            return
        if isinstance(msg, EngineDied):
            dead = msg.error if isinstance(msg.error, EngineDeadError) else \
                EngineDeadError(f"the engine loop failed: {msg.error}", msg.error)
            with self._calls_lock:
                self._dead, pending, self._calls = dead, self._calls, {}
            for fut in pending.values():
                fut.set_exception(dead)
            msg = EngineDied(dead)
        self._on_message(msg)


class ThreadEngineClient(EngineClient):
    """The loop in a thread of this process (the engine's CUDA work happens here too)."""

    def __init__(self, config: EngineConfig, on_message: Callable[[EngineEvent], None]) -> None:
        from distengine.engine_core import EngineCore
        from distengine.engine_loop import EngineLoop
        super().__init__(on_message)
        self.core = EngineCore(config)
        self.info = self.core.info
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        loop = EngineLoop(self.core, self._inbox, self._dispatch)
        self._thread = threading.Thread(target=loop.run, name="distengine-engine", daemon=True)
        self._thread.start()

    def send(self, command: EngineCommand) -> None:
        self._inbox.put(command)

    def shutdown(self) -> None:
        self._inbox.put(Shutdown())
        self._thread.join(timeout=30)
        self.core.shutdown()


class ProcessEngineClient(EngineClient):
    """The loop in a process of its own. `AsyncLLM` builds it; the constructor returns once the
    engine is up (its workers loaded, the KV cache sized), and raises the engine's own error
    (a ValueError for a config it refuses, ...) when it could not start."""

    def __init__(self, config: EngineConfig, on_message: Callable[[EngineEvent], None]) -> None:
        super().__init__(on_message)
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH")) if p)
        with theirs:
            self._proc = subprocess.Popen([sys.executable, "-m", "distengine.core_client", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), env=env)
        self._conn = Connection(ours.detach())
        self._send_lock = threading.Lock()  # event loops and the reader thread all send
        self._closing = False
        try:
            self._conn.send_bytes(pickle.dumps(config))
            msg = self._receive_while_alive()
        except BaseException:  # Ctrl-C while it starts, ...
            self._stop_process(grace=0)
            self._conn.close()
            raise
        if not isinstance(msg, Ready):
            self._stop_process(grace=30)
            self._conn.close()
            raise msg.error
        self.info = msg.info
        self._reader = threading.Thread(target=self._read, name="distengine-engine-reader", daemon=True)
        self._reader.start()

    def send(self, command: EngineCommand) -> None:
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except OSError:  # the process is gone: the reader thread reports it
            pass

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.send(Shutdown())
        self._stop_process(grace=60)
        self._conn.close()

    # ---- internals --------------------------------------------------------------------------
    def _receive_while_alive(self) -> Ready | StartFailed:
        """The process's first message (its start may take minutes: weights, graphs, Ray)."""
        while not self._conn.poll(0.5):
            if self._proc.poll() is not None:
                raise RuntimeError(f"the engine process exited with status {self._proc.returncode} while starting "
                                   f"(its output above says why)")
        try:
            return pickle.loads(self._conn.recv_bytes())
        except EOFError:
            self._proc.wait(timeout=30)
            raise RuntimeError(f"the engine process exited with status {self._proc.returncode} while starting "
                               f"(its output above says why)") from None

    def _read(self) -> None:
        while True:
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):
                if not self._closing:
                    try:
                        status = f"status {self._proc.wait(timeout=10)}"
                    except subprocess.TimeoutExpired:
                        status = "it closed its end and still runs"
                    self._dispatch(EngineDied(EngineDeadError(f"the engine process exited ({status})")))
                return
            try:
                msg = pickle.loads(data)
                self._dispatch(msg)
            except Exception as e:  # noqa: BLE001 - a front end that cannot take outputs ends the engine
                self._dispatch(EngineDied(EngineDeadError(f"handling the engine's output failed: {e}", e)))
                self.send(Shutdown())
                return
            if isinstance(msg, EngineDied):
                return

    def _stop_process(self, grace: float) -> None:
        """Wait `grace` seconds for it to end, then SIGTERM (it shuts its engine down), then SIGKILL."""
        for stop, wait in ((None, grace), (self._proc.terminate, 30), (self._proc.kill, None)):
            if stop is not None:
                stop()
            try:
                self._proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                pass


# ---- the engine process ------------------------------------------------------------------------
def _picklable(msg: EngineEvent) -> bytes:
    """`msg` pickled; an error in it that does not survive the round trip (pickling, or building it
    again from its arguments) goes as a RuntimeError with its text."""
    error = getattr(msg, "error", None)
    try:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        if error is not None:
            pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001
        fixed = dataclasses.replace(msg, error=RuntimeError(f"{type(error).__name__}: {error}"))
        return pickle.dumps(fixed, protocol=pickle.HIGHEST_PROTOCOL)


def _terminated(signum, frame) -> None:
    raise EngineDeadError("the engine process was terminated (SIGTERM)")


def _engine_process(fd: int) -> int:
    from distengine.engine_core import EngineCore
    from distengine.engine_loop import EngineLoop
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front end decides
    # SIGTERM (the front end's second resort) ends it through Python's exit path: the engine is shut
    # down (below, or by Ray's exit hooks while it starts), not left holding GPUs and actors.
    signal.signal(signal.SIGTERM, _terminated)
    conn = Connection(fd)
    config = pickle.loads(conn.recv_bytes())
    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - the front end raises it
        conn.send_bytes(_picklable(StartFailed(e)))
        return 1
    conn.send_bytes(pickle.dumps(Ready(core.info)))
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:  # a thread: the front end's sends never wait for a step to end
        while True:
            try:
                inbox.put(pickle.loads(conn.recv_bytes()))
            except (EOFError, OSError):  # the front end is gone
                inbox.put(Shutdown())
                return

    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def send() -> None:  # a thread: a front end that is behind holds up its messages, not the steps
        while (data := outbox.get()) is not None:
            try:
                conn.send_bytes(data)
            except OSError:  # the front end is gone; the receiving thread ends the loop
                return

    threading.Thread(target=receive, name="distengine-engine-inbox", daemon=True).start()
    sender = threading.Thread(target=send, name="distengine-engine-outbox", daemon=True)
    sender.start()
    try:
        EngineLoop(core, inbox, lambda msg: outbox.put(_picklable(msg))).run()
    finally:
        outbox.put(None)  # what was emitted (a last "dead") still goes out
        sender.join(timeout=30)
        core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(_engine_process(int(sys.argv[1])))
