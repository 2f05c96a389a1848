"""Beam search, as vLLM's `LLM.beam_search`: every step extends each live beam by one token,
taking the 2 x beam_width most likely continuations of each (the sampler's top logprobs), and
keeps the beam_width best of all by the length-normalised score; a beam that samples EOS (unless
ignore_eos) or reaches max_model_len is complete. The beams of one prompt are requests that share
the prompt's blocks, and each other's, through the prefix cache: a step recomputes at most the
last partial block of a beam.

`BeamSearch` holds one prompt's beams; a front end runs its steps (`requests`, `advance`) through
its own generate, so the offline and the served paths share the rule.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Integral, Real

from distengine.limits import MAX_INT
from distengine.sampling_params import SamplingParams

__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "BeamSearch"]

MAX_BEAM_WIDTH = 64  # each step asks the sampler for 2 x beam_width logprobs per beam


@dataclass
class BeamSearchParams:
    """vLLM's fields: beam_width, max_tokens, ignore_eos, temperature (of the step's logprobs),
    length_penalty (the score divides the cumulative logprob by length ** length_penalty),
    include_stop_str_in_output (no stop strings here: accepted for vLLM's signature)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name, lo, hi in (("beam_width", 1, MAX_BEAM_WIDTH), ("max_tokens", 1, MAX_INT)):
            v = getattr(self, name)
            if not isinstance(v, Integral) or isinstance(v, bool) or not lo <= v <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r:.40}")
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if not isinstance(v, Real) or isinstance(v, bool) or v != v or abs(v) == float("inf"):
                raise ValueError(f"{name} must be a finite number, got {v!r:.40}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be at least 0, got {self.temperature}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r:.40}")

    def step_params(self) -> SamplingParams:
        """What each beam's one-token request samples with."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=True)


@dataclass
class BeamSearchSequence:
    """A beam: its tokens (the prompt's first, as vLLM's), the logprobs of each step, the
    cumulative logprob of its own tokens, its text (of all tokens) once done."""
    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


class BeamSearch:
    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids, max_model_len: int):
        self.params, self.eos, self.max_model_len = params, frozenset(eos_token_ids), max_model_len
        self.prompt_len = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def requests(self) -> list[list[int]]:
        """The token ids of each live beam: one request each this step."""
        return [b.tokens for b in self.beams]

    def score(self, beam: BeamSearchSequence) -> float:
        """vLLM's: the cumulative logprob over the length (EOS not counted) ** length_penalty."""
        length = len(beam.tokens) - (1 if beam.tokens[-1] in self.eos else 0)
        return beam.cum_logprob / (length ** self.params.length_penalty)

    def advance(self, step_logprobs: list[dict[int, float]]) -> None:
        """Each live beam's logprobs of its next token (the top 2 x beam_width), in `requests` order."""
        if len(step_logprobs) != len(self.beams):
            raise ValueError(f"{len(self.beams)} beams got {len(step_logprobs)} results")
        self.steps += 1
        grown = []
        for beam, lps in zip(self.beams, step_logprobs):
            for token, lp in lps.items():
                new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [lps], beam.cum_logprob + lp)
                if token in self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self.completed.append(new)
                elif len(new.tokens) >= self.max_model_len:
                    new.finish_reason = "length"
                    self.completed.append(new)
                else:
                    grown.append(new)
        self.beams = sorted(grown, key=self.score, reverse=True)[:self.params.beam_width]

    def result(self, detokenize) -> BeamSearchOutput:
        """The beam_width best of the completed and live beams, best first; `detokenize` (token
        ids -> text) gives each its text, or None."""
        for b in self.beams:
            b.finish_reason = b.finish_reason or "length"
        best = sorted(self.completed + self.beams, key=self.score, reverse=True)[:self.params.beam_width]
        for b in best:
            b.text = detokenize(b.tokens) if detokenize is not None else None
        return BeamSearchOutput(best)
