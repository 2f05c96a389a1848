"""Request outputs returned by `LLM.generate` (shaped as vLLM's)."""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CompletionOutput", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One completion of a request.

    index: completion index within the request (0 while n == 1).
    text: detokenised output text ("" when the engine runs without a tokenizer); ends before a
        matched stop string unless ``include_stop_str_in_output``.
    token_ids: the generated token ids (a stop token id / EOS that ended the request is kept).
    finish_reason: None while running, "stop" (EOS, stop token id or stop string), "length"
        (max_tokens or max_model_len), "abort" (aborted) or "error" (the driver could not serve
        it; the message is in stop_reason).
    stop_reason: the matched stop string (str) or stop token id (int); None for EOS, for
        "length", and while running; the message of an "error".
    logprobs: None unless asked; else one dict {token_id: logprob} per generated position (the
        sampled token plus the top-k).
    cumulative_logprob: sum of the sampled tokens' logprobs (None unless logprobs were asked).
    """
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"CompletionOutput(index={self.index}, text={self.text!r}, "
                f"token_ids={self.token_ids}, finish_reason={self.finish_reason!r}, "
                f"stop_reason={self.stop_reason!r}, cumulative_logprob={self.cumulative_logprob}, "
                f"logprobs={_short_logprobs(self.logprobs)})")


@dataclass
class RequestOutput:
    """The output of one request: its prompt, how much of it came from the prefix cache, and its
    completions (``outputs[0]`` while n == 1). With `prompt_logprobs` asked: per prompt token
    {token id: logprob} of it and the top-k (None for the first token), and its rank in the
    vocabulary (`prompt_logprob_ranks`, 1: the most likely); in a stream, with the first delta."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = False
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, "
                f"num_cached_tokens={self.num_cached_tokens}, finished={self.finished}, "
                f"outputs={self.outputs!r})")


def _short_logprobs(lps: list[dict[int, float]] | None) -> str:
    if lps is None:
        return "None"
    return f"[{len(lps)} positions]"
