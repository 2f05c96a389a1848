"""Incremental detokenisation and stop-string checks (vLLM semantics).

`IncrementalDetokenizer` turns the output token ids of one request into text step by step.  It
uses the prefix-offset / read-offset window of vLLM's ``detokenize_incrementally``, over token
*ids*: each step decodes ``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]`` and
emits the difference, so the cost per step is independent of the output length, and

* a multi-byte character split over several (byte) tokens is emitted only once complete (while
  the window's text ends with U+FFFD the offsets do not move and nothing is emitted);
* sentencepiece / Metaspace tokenizers, whose decoder strips the leading space of the first
  token, see the same stripping in both windows, so the difference keeps the space.

Contract: the concatenation of every piece `append` returned (plus `flush`, which only matters
when the output ends in an incomplete / invalid UTF-8 sequence) equals
``tokenizer.decode(all_output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``
i.e. ``tokenizer.decode(all_output_ids, skip_special_tokens=...)`` for every tokenizer whose
``clean_up_tokenization_spaces`` is False (the default of transformers 5 and of modern LLM
tokenizers).  Text is the output's own (like HF ``generate`` + ``decode`` of the new tokens);
the prompt is not used as decoding context.  Emitted text is never retracted: after every call
the text so far is a prefix of the final text.

`check_stop_strings` is vLLM's ``StopChecker.check_stop_strings`` (see its docstring).
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["IncrementalDetokenizer", "check_stop_strings"]

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Detokenises one request's output incrementally.

    tokenizer: a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=...)``),
        or None: then every piece is "" (models run without tokenizers).
    prompt_token_ids: the request's prompt ids (kept for reference; the text is the output's
        own, see the module docstring).
    skip_special_tokens: passed to ``decode``.
    """

    def __init__(self, tokenizer: Any | None, prompt_token_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids or [])
        self.skip_special_tokens = bool(skip_special_tokens)
        self.token_ids: list[int] = []  # all output ids appended so far
        self.output_text = ""           # every piece returned so far, concatenated
        self.prefix_offset = 0
        self.read_offset = 0
        self._cleanup_kw = True         # decode accepts clean_up_tokenization_spaces

    # ------------------------------------------------------------------ decoding
    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._cleanup_kw:
            try:
                return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                             clean_up_tokenization_spaces=False)
            except TypeError:
                self._cleanup_kw = False
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_ids: Sequence[int]) -> str:
        """Add newly generated token ids; return the newly decoded text (maybe "")."""
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            return ""
        self.token_ids.extend(token_ids)
        if self.tokenizer is None:
            return ""
        ids = self.token_ids
        prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(ids[self.prefix_offset:])
        if new_text.endswith(_REPLACEMENT):
            # Incomplete multi-byte character: wait for the next tokens.
            return ""
        if not new_text.startswith(prefix_text):
            # The window's text rewrote its earlier part (exotic decoders): resync on the full
            # decode, emitting whatever extends what was already emitted.
            return self._resync()
        if len(new_text) <= len(prefix_text):
            # Nothing visible yet (e.g. skipped special tokens): keep the window.
            return ""
        piece = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        self.output_text += piece
        return piece

    def _resync(self) -> str:
        full = self._decode(self.token_ids)
        if full.endswith(_REPLACEMENT) or not full.startswith(self.output_text):
            return ""
        piece = full[len(self.output_text):]
        self.output_text = full
        # Restart the window from the last token: its text is complete here.
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(0, self.read_offset - 1)
        # The restarted window must agree with what was emitted; if it does not, keep decoding
        # from scratch (prefix_offset 0) which is always consistent with the full decode.
        if self.prefix_offset:
            tail = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
            if not self.output_text.endswith(tail):
                self.prefix_offset = 0
        return piece

    def flush(self) -> str:
        """At the end of a request: emit text held back because the output ends in an incomplete
        or invalid UTF-8 sequence (rendered as U+FFFD by ``decode``).  Usually ""."""
        if self.tokenizer is None or not self.token_ids:
            return ""
        full = self._decode(self.token_ids)
        if not full.startswith(self.output_text):
            return ""
        piece = full[len(self.output_text):]
        self.output_text = full
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return piece


def check_stop_strings(text: str, new_text_len: int, stop: Sequence[str],
                       include: bool) -> tuple[str, str | None]:
    """Look for a stop string that ends inside the last ``new_text_len`` characters of ``text``.

    Returns ``(truncated_text, matched_stop)``: the text cut just before the stop string (just
    after it when ``include``), or ``(text, None)`` when no stop string ends in the new text.

    Each stop string ``s`` is searched from ``len(text) - new_text_len - len(s) + 1`` (so matches
    straddling the old/new boundary are found, matches wholly inside old text are not: they were
    checked when that text was new).  When several match, the one that *ends* first wins (ties:
    the one that starts first, i.e. the longer), which is what a character-by-character stream
    would have hit first, so the result does not depend on how the text was chunked.
    """
    if new_text_len <= 0 or not stop:
        return text, None
    n = len(text)
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for s in stop:
        if not s:
            continue
        start = text.find(s, max(0, n - new_text_len - len(s) + 1))
        if start == -1:
            continue
        cand = (start + len(s), start, s)
        if best is None or cand[:2] < best[:2]:
            best = cand
    if best is None:
        return text, None
    end, start, s = best
    return (text[:end] if include else text[:start]), s
