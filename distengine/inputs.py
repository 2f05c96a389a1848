"""The input contract: what a request must be before it reaches the scheduler, the same at every
tensor-parallel size. A bad request raises `TypeError` (wrong kind of value) or `ValueError` (a
value out of range) naming the field and the value; nothing of it reaches a worker, and the engine
serves the next call.

- prompts: a string (the model needs a tokenizer), a `{"prompt_token_ids": [...]}` dict (an optional
  "prompt" keeps the text for the output), or a list of them; never empty, shorter than
  max_model_len.
- token ids (prompts and `stop_token_ids`): Python or numpy integers in [0, vocab_size); strings,
  floats and bools are refused, not converted.
- sampling params: one `SamplingParams` for every prompt, or one per prompt (checked when built,
  against `distengine.limits`); `logprobs` -1 means the whole vocabulary (vLLM's meaning),
  otherwise at most vocab_size.
"""
from __future__ import annotations

from collections.abc import Sequence
from numbers import Integral

from distengine import structured_outputs
from distengine.limits import MAX_TOKEN_IDS
from distengine.sampling_params import SamplingParams

PROMPT_KEYS = ("prompt_token_ids", "prompt")
# Prompt keys and chat content parts that carry images, audio or video (vLLM's and OpenAI's
# names): refused by name, since of a multimodal checkpoint only the language model is served.
MEDIA_PROMPT_KEYS = ("multi_modal_data", "multi_modal_uuids", "mm_processor_kwargs")
MEDIA_PART_TYPES = frozenset({"image_url", "image", "input_image", "image_pil", "image_embeds", "video_url", "video",
                              "input_audio", "audio_url", "audio", "file", "input_file"})
NO_MEDIA = "images, audio and video are not supported (only the text part of a multimodal model is served)"


def check_message_content(content, field: str) -> None:
    """A chat message's content: a string, None, or a list of {'type': 'text', 'text': str}
    parts; a media part is refused by its type."""
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise TypeError(f"{field} must be a string or a list of content parts, got {type(content).__name__}")
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PART_TYPES:
            raise ValueError(f"{field}[{i}] is a {kind!r} part: {NO_MEDIA}")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise TypeError(f"{field}[{i}] must be a {{'type': 'text', 'text': str}} part, got {part!r:.80}")


def as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        return list(prompts)
    raise TypeError(f"prompts must be a string, a {{'prompt_token_ids': [...]}} dict or a list of them, "
                    f"got {type(prompts).__name__} {prompts!r:.80}")


def as_params_list(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, bytes)):
        params = list(sampling_params)
        bad = [i for i, p in enumerate(params) if not isinstance(p, SamplingParams)]
        if bad:
            raise TypeError(f"sampling_params[{bad[0]}] must be a SamplingParams, got {type(params[bad[0]]).__name__}")
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} prompts: give one, or one per prompt")
        return params
    raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                    f"got {type(sampling_params).__name__}")


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, structured_outputs_backend: str = "auto") -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, int(vocab_size), max_model_len
        self.structured_outputs_backend = structured_outputs_backend  # the engine's: which library checks a spec

    def token_ids(self, ids, field: str, at_most: int = MAX_TOKEN_IDS) -> list[int]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise TypeError(f"{field} must be a list of token ids, got {type(ids).__name__} {ids!r:.80}")
        if len(ids) > at_most:
            raise ValueError(f"{field} holds {len(ids)} token ids; at most {at_most} fit")
        out = []
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, Integral):
                raise TypeError(f"{field}[{i}] must be an integer token id, got {type(t).__name__} {t!r}")
            t = int(t)
            if not 0 <= t < self.vocab_size:
                raise ValueError(f"{field}[{i}] = {t} is not a token id of this model: ids lie in "
                                 f"[0, {self.vocab_size})")
            out.append(t)
        return out

    def prompt(self, p, index: int) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt, checked."""
        field = f"prompts[{index}]"
        if isinstance(p, str):
            if self.tokenizer is None:
                raise ValueError(f"{field}: this model has no tokenizer: give prompts as {{'prompt_token_ids': [...]}}")
            try:
                encoded = self.tokenizer(p)["input_ids"]
            except (TypeError, ValueError, UnicodeError) as e:  # e.g. a lone surrogate
                raise ValueError(f"{field} cannot be tokenized (invalid text, e.g. a lone surrogate): {e}") from None
            text, ids = p, self.token_ids(encoded, field)
        elif isinstance(p, dict):
            media = [k for k in MEDIA_PROMPT_KEYS if k in p]
            if media:
                raise ValueError(f"{field}[{media[0]!r}]: {NO_MEDIA}")
            unknown = sorted(set(p) - set(PROMPT_KEYS), key=str)
            if unknown:
                raise ValueError(f"{field} has unknown key(s) {unknown}: a prompt dict holds {list(PROMPT_KEYS)}")
            if "prompt_token_ids" not in p:
                raise ValueError(f"{field} needs 'prompt_token_ids'")
            text = p.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"{field}['prompt'] must be a string, got {type(text).__name__}")
            raw = p["prompt_token_ids"]
            if isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)):
                self._fits(len(raw), field)  # before a huge list is walked
            ids = self.token_ids(raw, f"{field}['prompt_token_ids']")
        else:
            raise TypeError(f"{field} must be a string or a {{'prompt_token_ids': [...]}} dict, "
                            f"got {type(p).__name__} {p!r:.80}")
        if not ids:
            raise ValueError(f"{field} is empty")
        self._fits(len(ids), field)
        return text, ids

    def _fits(self, length: int, field: str) -> None:
        if length >= self.max_model_len:
            raise ValueError(f"{field} is {length} tokens long but max_model_len is {self.max_model_len}: "
                             f"at most {self.max_model_len - 1} prompt tokens fit")

    def params(self, sp: SamplingParams, index: int) -> None:
        field = f"sampling_params[{index}]" if index >= 0 else "sampling_params"
        self.token_ids(sp.stop_token_ids, f"{field}.stop_token_ids")
        if sp.logit_bias:
            self.token_ids(list(sp.logit_bias), f"{field}.logit_bias (its keys)")
        if sp.allowed_token_ids:
            self.token_ids(sp.allowed_token_ids, f"{field}.allowed_token_ids")
        try:
            sp.tokenize_bad_words(self.tokenizer)
        except ValueError as e:
            raise ValueError(f"{field}.{e}") from None
        for i, ids in enumerate(sp.bad_words_token_ids or ()):
            self.token_ids(ids, f"{field}.bad_words (its tokens, word {i})")
        if sp.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError(f"{field}.structured_outputs needs the model's tokenizer (this model has none)")
            try:
                structured_outputs.check(sp.structured_outputs, self.structured_outputs_backend)
            except ValueError as e:
                raise ValueError(f"{field}.{e}") from None
        if sp.logprobs is not None and sp.logprobs > self.vocab_size:
            raise ValueError(f"{field}.logprobs = {sp.logprobs} exceeds the vocabulary ({self.vocab_size}); "
                             f"-1 asks for all of it")

    def requests(self, prompts, sampling_params) -> list[tuple[str | None, list[int], SamplingParams]]:
        """Every prompt and its params, checked before any of them is queued."""
        items = as_prompt_list(prompts)
        params = as_params_list(sampling_params, len(items))
        shared = isinstance(sampling_params, SamplingParams) or sampling_params is None
        out = []
        for i, (p, sp) in enumerate(zip(items, params)):
            if not shared or i == 0:
                self.params(sp, -1 if shared else i)
            text, ids = self.prompt(p, i)
            out.append((text, ids, sp))
        return out
