"""The OpenAI-compatible API's request bodies (pydantic, as vLLM's server) and their translation to
the engine's `SamplingParams`. Fields OpenAI defines and vLLM's extras (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...) are read; unknown fields are
ignored, as vLLM does; a known field of the wrong type is a 400 naming it. Token ids must be
integers (no strings, floats or bools)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from distengine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 63)  # vLLM's range (a C long)
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for what we cannot serve, checked before any work."""
        out = []
        if self.n != 1:
            out.append(("n", "only n=1 is supported"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options needs stream: true"))
        return out

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        kw = dict(n=self.n, max_tokens=max_tokens, stop=self.stop, seed=self.seed, ignore_eos=self.ignore_eos,
                  min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids, logprobs=logprobs,
                  skip_special_tokens=self.skip_special_tokens,
                  include_stop_str_in_output=self.include_stop_str_in_output)
        for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                              ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            value = getattr(self, name)
            kw[name] = default if value is None else value
        return SamplingParams(**kw)


PromptInput = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(_Sampling):
    prompt: PromptInput
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "echo is not supported"))
        if self.best_of not in (None, 1):
            out.append(("best_of", f"best_of must be 1 (only n=1 is supported), got {self.best_of}"))
        if self.suffix:
            out.append(("suffix", "suffix is not supported"))
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            out.append(("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}"))
        return out

    def prompts(self) -> list:
        """The prompts as the engine takes them (text, or {'prompt_token_ids': [...]})."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        return [x if isinstance(x, str) else {"prompt_token_ids": list(x)} for x in p]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list | None = None
    response_format: dict | None = None
    add_generation_prompt: bool = True

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.tools:
            out.append(("tools", "tool calls are not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "structured output is not supported"))
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            out.append(("top_logprobs", f"top_logprobs must be in [0, 20], got {self.top_logprobs}"))
        if self.top_logprobs and not self.logprobs:  # vLLM's rule: it would be ignored silently
            out.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        return out

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]
