"""The messages between a serving engine's loop and its front end (`distengine.engine_loop`,
`distengine.core_client`), in a thread or pickled across a process boundary.

To the loop: `AddRequest`, `AbortRequest`, `FinishRequest` (a stop string the front end found),
`UtilityCall` (one of the loop's `UTILITIES`, between two steps), `Shutdown`.
From the loop: `Ready` or `StartFailed` (a process's first message), `StepOutputs` after each step
that produced tokens, `IdleStats` when the engine falls idle and every so often while it is,
`Refused` (a request the engine would not take), `Reply` (a utility's result), and `EngineDied`
as the last message when the engine failed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from distengine.scheduler import EngineRequest, RequestUpdate, SchedulerStats


# ---- to the loop ---------------------------------------------------------------------------------
@dataclass
class AddRequest:
    request: EngineRequest


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class FinishRequest:
    request_id: str
    stop_reason: str  # the stop string


@dataclass
class UtilityCall:
    call_id: int
    method: str
    args: tuple = ()


@dataclass
class Shutdown:
    pass


EngineCommand = AddRequest | AbortRequest | FinishRequest | UtilityCall | Shutdown


# ---- from the loop -------------------------------------------------------------------------------
@dataclass
class Ready:
    info: Any  # the engine's EngineInfo


@dataclass
class StartFailed:
    error: BaseException


@dataclass
class StepOutputs:
    """A step's updates, as plain tuples on the wire: pickling hundreds of dataclasses a step
    would cost the loop several times as much (`updates()` builds them on the receiving side)."""
    rows: list[tuple] = field(default_factory=list)
    stats: SchedulerStats | None = None

    @classmethod
    def of(cls, updates: list[RequestUpdate], stats: SchedulerStats) -> "StepOutputs":
        return cls([(u.req_id, u.token_id, u.logprobs, u.finish_reason, u.stop_reason, u.num_cached_tokens)
                    if u.prompt_logprobs is None else
                    (u.req_id, u.token_id, u.logprobs, u.finish_reason, u.stop_reason, u.num_cached_tokens,
                     u.prompt_logprobs, u.prompt_ranks) for u in updates], stats)

    def updates(self) -> list[RequestUpdate]:
        return [RequestUpdate(*r) for r in self.rows]


@dataclass
class IdleStats:
    stats: SchedulerStats


@dataclass
class Refused:
    request_id: str
    error: BaseException


@dataclass
class Reply:
    call_id: int
    error: BaseException | None
    value: Any = None


@dataclass
class EngineDied:
    error: BaseException


EngineEvent = Ready | StartFailed | StepOutputs | IdleStats | Refused | Reply | EngineDied
