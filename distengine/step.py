"""One engine step as typed data, shared by the scheduler, the executor and every worker, and
what comes back. Both travel as msgpack bytes (the same bytes to every rank).

A request's block tables go to the workers once, when it (re)enters them (`NewRequest`); after
that a step only carries what changed (`ScheduledRequest`): the tokens the host knows among those
to compute, and the block ids appended to its tables. The token sampled in the previous step
never comes from the host: it stays on the device where it was sampled (see `token_ids`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import msgpack


MAX_BAD_WORD_TOKENS = 16  # tokens of one bad word: the workers keep each row's last 15 outputs


@dataclass(frozen=True)
class RequestSampling:
    """How the workers sample one request: its `SamplingParams`, checked once on the driver, in
    the few fields a worker reads (`SamplingParams.for_workers`). The vocabulary's bounds are the
    worker's to apply: a top_k at or past the vocabulary is no top-k, logprobs -1 is all of it."""
    temperature: float = 0.0          # 0: greedy
    top_k: int = 0                    # 0: off
    top_p: float = 1.0                # 1: off
    min_p: float = 0.0                # 0: off
    presence_penalty: float = 0.0     # 0: off
    frequency_penalty: float = 0.0    # 0: off
    repetition_penalty: float = 1.0   # 1: off
    seed: int | None = None           # its low 64 bits, as a signed int64
    logprobs: int | None = None       # None: none; k: the sampled token's and the top k; -1: every token's
    # Logit adjustments, before the penalties (vLLM's order); sequences (lists once decoded).
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias) pairs added to the logits
    allowed_token_ids: tuple[int, ...] = ()  # when not empty, every other token is barred
    min_tokens: int = 0                     # `stop_ids` are barred until this many output tokens
    stop_ids: tuple[int, ...] = ()          # EOS (unless ignore_eos) and stop_token_ids
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences whose last token is barred after the rest
    prompt_logprobs: int | None = None      # k: every prompt token's logprob and the top k

    def __post_init__(self) -> None:
        # msgpack gives sequences back as lists: tuples keep the record equal to the one sent.
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "stop_ids", tuple(self.stop_ids))
        object.__setattr__(self, "bad_words", tuple(tuple(w) for w in self.bad_words))

    @property
    def reads_outputs(self) -> bool:
        """A bad word of several tokens: the workers keep the row's last outputs on the device."""
        return any(len(w) > 1 for w in self.bad_words)

    @property
    def adjusts_logits(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or (self.min_tokens and self.stop_ids) or self.bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """A penalty is on: the workers keep the counts of the request's output tokens."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def reads_prompt(self) -> bool:
        """The repetition penalty also counts the prompt's tokens."""
        return self.repetition_penalty != 1.0


@dataclass
class NewRequest:
    """A request entering the workers (admitted, or resumed after a preemption)."""
    req_id: str
    block_ids: list[list[int]]   # its whole table in every KV cache group (prefix hits included)
    sampling: RequestSampling
    num_output_tokens: int = 0   # a resumed request's outputs so far (seeded draws go on from there)
    # Only when a penalty needs them (else empty): the prompt, and a resumed request's outputs.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class ScheduledRequest:
    """One request's share of a step: tokens [num_computed_tokens, + num_new_tokens)."""
    req_id: str
    num_computed_tokens: int
    num_new_tokens: int
    # The new tokens the host knows, in order: all of them, or all but the last when the last is
    # the token this request sampled in the previous step (still in flight to the host).
    token_ids: list[int]
    # Block ids appended to each group's table; [] when nothing was appended in any group.
    new_block_ids: list[list[int]]
    sample: bool                 # the step reaches the request's end: sample its next token

    @property
    def uses_device_token(self) -> bool:
        return len(self.token_ids) < self.num_new_tokens


@dataclass
class GrammarMasks:
    """Structured outputs: the tokens each grammar allows at one step's sampling rows, a bit per
    token (little-endian int32 words of 32 tokens each, covering the model's vocabulary). A
    sampling row without an entry may take any token."""
    step_id: int
    masks: dict[str, bytes] = field(default_factory=dict)  # req_id -> bitmask


@dataclass
class StepPlan:
    """What every rank runs this step (vLLM's SchedulerOutput)."""
    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in batch order
    finished_req_ids: list[str] = field(default_factory=list)  # finished, aborted or preempted
    # Overlapped execution: the workers launch this step and return the previous one's output.
    defer_output: bool = False
    # Structured outputs, overlapped: this step's grammars wait on the tokens of the step before,
    # so the workers run its forward now and sample once the next plan brings its masks.
    masks_follow: bool = False
    # The masks of this step (not overlapped) or of the step before, whose sampling waits on them.
    grammar_masks: GrammarMasks | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def encode(self) -> bytes:
        """The msgpack bytes every rank gets; `StepEncodingError` names the requests whose part
        cannot be encoded (their checked fields never fail; this is the last line behind them)."""
        new = [[r.req_id, r.block_ids, _row(r.sampling), *_row(r)[3:]] for r in self.new_requests]
        scheduled = [_row(s) for s in self.scheduled]
        try:
            masks = None if self.grammar_masks is None else _row(self.grammar_masks)
            return msgpack.packb([self.step_id, new, scheduled, self.finished_req_ids, self.defer_output,
                                  self.masks_follow, masks])
        except (OverflowError, TypeError, ValueError) as e:
            bad = [row[0] for row in new + scheduled if not _packs(row)]
            raise StepEncodingError(f"step {self.step_id} cannot be encoded: {type(e).__name__}: {e}", bad) from e

    @classmethod
    def decode(cls, data: bytes) -> "StepPlan":
        step_id, new, scheduled, finished, defer, follow, masks = msgpack.unpackb(data, raw=False,
                                                                                 strict_map_key=False)
        return cls(step_id, [NewRequest(rid, blocks, RequestSampling(*sampling), *rest)
                             for rid, blocks, sampling, *rest in new],
                   [ScheduledRequest(*s) for s in scheduled], finished, defer, follow,
                   None if masks is None else GrammarMasks(*masks))


@dataclass
class StepOutput:
    """Rank 0's result of a step: one entry per scheduled request that sampled, in plan order."""
    step_id: int
    req_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None            # the sampled tokens' logprobs
    top_token_ids: list[list[int]] | None = None   # per request, the top-k (k = the step's largest ask)
    top_logprobs: list[list[float]] | None = None
    # Requests whose prompt logprobs are complete (they sample their first token in this step):
    # req_id -> [prompt tokens 1.., their logprobs, their ranks, top ids per token, top logprobs].
    prompt_logprobs: dict[str, list[list]] | None = None

    def encode(self) -> bytes:
        return msgpack.packb(_row(self))

    @classmethod
    def decode(cls, data: bytes) -> "StepOutput":
        return cls(*msgpack.unpackb(data, raw=False))


class StepEncodingError(ValueError):
    """A step that msgpack cannot carry; `req_ids`: the requests whose own part it cannot."""

    def __init__(self, message: str, req_ids: list[str]) -> None:
        super().__init__(message)
        self.req_ids = req_ids


def _packs(row: list) -> bool:
    try:
        msgpack.packb(row)
        return True
    except (OverflowError, TypeError, ValueError):
        return False


def _row(obj) -> list:
    return [getattr(obj, f.name) for f in fields(obj)]
