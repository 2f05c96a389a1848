"""Ctrl-C between steps, not inside one: a step changes the scheduler, the workers' persistent
batch and, at TP > 1, a compiled graph that hands results out in order; cut in the middle, they
disagree for good. So a Ctrl-C that arrives while a step runs is held until the step ends and
raised then, where the caller (`LLM.generate`) can abort its requests and leave the engine as
good as before. A second Ctrl-C during the same step is raised at once (the engine is then
dead, rather than hung)."""
from __future__ import annotations

import contextlib
import signal
import threading


@contextlib.contextmanager
def interrupts_held():
    """Hold SIGINT for the block, where Python's own Ctrl-C handler is in place (the main thread
    of a program that did not set one of its own, or ignore it as the engine process does)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    held: list[int] = []

    def hold(signum, frame) -> None:
        if held:
            raise KeyboardInterrupt
        held.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt
