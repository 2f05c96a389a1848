"""User-facing sampling parameters (vLLM-compatible subset).

`SamplingParams` validates itself on construction (``__post_init__``) and raises ``ValueError``
messages that start with the offending field's name, worded as vLLM's ``_verify_args`` words
them.  `for_workers` gives the record the workers sample with (`distengine.step.RequestSampling`).

Normalisations (as vLLM's ``__post_init__``):

* ``stop``: ``None`` -> ``[]``, a string -> ``[string]``;
* ``stop_token_ids``: ``None`` -> ``[]``, duplicates removed (first occurrence kept);
* ``seed == -1`` -> ``None``; ``logprobs is True`` -> ``1``;
* greedy (``temperature < 1e-5``): ``top_p = 1.0``, ``top_k = 0``, ``min_p = 0.0``.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from typing import Any

from distengine.config import STRUCTURED_OUTPUTS_BACKENDS
from distengine.limits import (MAX_INT, MAX_N, MAX_PROMPT_LOGPROBS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                               MAX_STOP_TOKEN_IDS, MAX_TOKEN_IDS, bad_text)
from distengine.step import MAX_BAD_WORD_TOKENS, RequestSampling

__all__ = ["SamplingParams", "StructuredOutputsParams", "SAMPLING_EPS"]

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_MASK64 = (1 << 64) - 1


def _is_int(v: Any) -> bool:
    return isinstance(v, Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, Real) and not isinstance(v, bool)


def _finite(v: Real) -> bool:
    """A float can hold it, and it is not inf or NaN (an int past a float's range is not finite)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's fields; exactly one set): a JSON schema (a dict or its
    JSON text), a regular expression, one of a list of strings, a grammar, or any JSON object
    (`json_object`). The engine compiles it against the model's tokenizer when the request enters
    (`distengine.structured_outputs`), with the library `backend` names: "xgrammar" (a grammar
    is then EBNF, xgrammar's dialect) or "guidance" (llguidance; a grammar is then Lark); None or
    "auto" leave it to the engine's `structured_outputs_backend`."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    backend: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r:.40}.")
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs: exactly one of json, regex, choice, grammar, json_object must be "
                             f"set, got {', '.join(given) or 'none'}.")
        if self.backend is not None and (not isinstance(self.backend, str)
                                         or self.backend not in STRUCTURED_OUTPUTS_BACKENDS):
            raise ValueError(f"structured_outputs.backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)} "
                             f"(or None), got {self.backend!r:.40}.")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its JSON text), got "
                             f"{type(self.json).__name__}.")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v or bad_text(v)):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r:.80}.")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) and c and not bad_text(c) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                                 f"{self.choice!r:.80}.")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """The one field set."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


@dataclass
class SamplingParams:
    """Sampling parameters for one request (see vLLM's ``SamplingParams``).

    n: completions per prompt (they share the prompt's blocks: `distengine.parallel_sampling`).
    best_of: completions generated, of which the n of highest cumulative logprob are returned
        (None: n).
    temperature: 0 (or < 1e-5) = greedy.
    top_p: nucleus probability in (0, 1]; 1 = off.
    top_k: 0 or -1 = off, else keep the k most likely tokens.
    min_p: in [0, 1]; drop tokens with prob < min_p * max prob; 0 = off.
    presence_penalty / frequency_penalty: in [-2, 2]; 0 = off.
    repetition_penalty: > 0; 1 = off.
    max_tokens: >= 1, or None = up to the model's max_model_len.
    min_tokens: EOS (unless ignore_eos) and stop_token_ids cannot be sampled before this many
        output tokens (their logits are barred, as vLLM's), nor stop strings end the request.
    stop: stop strings (the output text ends before the first one, unless
        include_stop_str_in_output).
    stop_token_ids: extra token ids that end the request (the token is kept in token_ids).
    ignore_eos: keep generating past EOS.
    seed: per-request seed (None = engine's generator).
    logprobs: None = none; k >= 0 = the sampled token's logprob plus the top-k; -1 = whole vocab.
    prompt_logprobs: None = none; k in [0, 20]: each prompt token's logprob (given the tokens
        before it; the first has none) plus the top-k. The prompt is then computed whole: no
        prefix-cache hit.
    include_stop_str_in_output: keep the matched stop string in the text.
    skip_special_tokens: drop special tokens from the detokenised text.
    logit_bias: {token id: bias} added to the logits before the penalties (finite values).
    allowed_token_ids: when given (not empty), only these tokens can be sampled.
    bad_words: words never generated (vLLM's rule: each word's tokens, with and without a leading
        space; a one-token word is barred always, a longer one's last token after the others).
    structured_outputs: the output follows a JSON schema, a regex, a choice or a grammar
        (`StructuredOutputsParams`); not with ignore_eos, min_tokens or beam search.
    """
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # bad_words as token ids: the front end's tokenizer fills it (`tokenize_bad_words`).
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        # Normalise first (as vLLM), then verify.
        if self.seed == -1 and _is_int(self.seed):
            self.seed = None
        if self.logprobs is True:
            self.logprobs = 1

        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ValueError(
                f"stop must be a string or a list of strings, got {type(self.stop).__name__}.")

        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple, set, frozenset)):
            self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        else:
            raise ValueError(f"stop_token_ids must be a list of integers, got "
                             f"{type(self.stop_token_ids).__name__}.")

        self._verify_args()
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(dict.fromkeys(int(t) for t in self.allowed_token_ids))
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)

        # Canonical Python scalars (msgpack-friendly, no numpy scalars leaking through).
        self.n = int(self.n)
        if self.best_of is not None:
            self.best_of = int(self.best_of)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.top_k = int(self.top_k)
        self.min_p = float(self.min_p)
        self.presence_penalty = float(self.presence_penalty)
        self.frequency_penalty = float(self.frequency_penalty)
        self.repetition_penalty = float(self.repetition_penalty)
        if self.max_tokens is not None:
            self.max_tokens = int(self.max_tokens)
        self.min_tokens = int(self.min_tokens)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.seed is not None:
            self.seed = int(self.seed)
        if self.logprobs is not None:
            self.logprobs = int(self.logprobs)

        if self.temperature < SAMPLING_EPS:
            # Zero temperature means greedy sampling: the truncations are meaningless.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    def _verify_args(self) -> None:
        # n
        if not _is_int(self.n):
            raise ValueError(f"n must be an int, got {type(self.n).__name__}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}.")
        if self.best_of is not None:
            if not _is_int(self.best_of):
                raise ValueError(f"best_of must be an int, got {type(self.best_of).__name__}.")
            if not self.n <= self.best_of <= MAX_N:
                raise ValueError(f"best_of must be at least n={self.n} and at most {MAX_N}, got {self.best_of}.")
        # penalties
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            v = getattr(self, name)
            if not _is_real(v):
                raise ValueError(f"{name} must be a number, got {type(v).__name__}.")
            if not lo <= v <= hi:  # NaN fails too
                raise ValueError(f"{name} must be in [-2, 2], got {v}.")
        rp = self.repetition_penalty
        if not _is_real(rp):
            raise ValueError(f"repetition_penalty must be a number, got {type(rp).__name__}.")
        if not _finite(rp):
            raise ValueError(f"repetition_penalty must be a finite number, got {rp}.")
        if rp <= 0.0:
            raise ValueError(f"repetition_penalty must be greater than zero, got {rp}.")
        if not 1e-30 <= rp <= 1e30:  # the sampler works in float32: 0 or inf there give NaN logits
            raise ValueError(f"repetition_penalty must be in [1e-30, 1e30], got {rp}.")
        # temperature
        t = self.temperature
        if not _is_real(t):
            raise ValueError(f"temperature must be a number, got {type(t).__name__}.")
        if not _finite(t):
            raise ValueError(f"temperature must be a finite number, got {t}.")
        if t < 0.0:
            raise ValueError(f"temperature must be non-negative, got {t}.")
        # top_p / top_k / min_p
        if not _is_real(self.top_p):
            raise ValueError(f"top_p must be a number, got {type(self.top_p).__name__}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.top_k > MAX_INT:
            raise ValueError(f"top_k must be at most {MAX_INT} (a top_k past the vocabulary is no top-k), "
                             f"got {self.top_k}.")
        if not _is_real(self.min_p):
            raise ValueError(f"min_p must be a number, got {type(self.min_p).__name__}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        # lengths
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens):
                raise ValueError(f"max_tokens must be an integer or None, got "
                                 f"{type(self.max_tokens).__name__}.")
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
            if self.max_tokens > MAX_INT:
                raise ValueError(f"max_tokens must be at most {MAX_INT}, got {self.max_tokens}.")
        if not _is_int(self.min_tokens):
            raise ValueError(f"min_tokens must be an integer, got "
                             f"{type(self.min_tokens).__name__}.")
        if self.min_tokens < 0:
            raise ValueError(
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.min_tokens > MAX_INT:
            raise ValueError(f"min_tokens must be at most {MAX_INT}, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be less than or equal to "
                             f"max_tokens={self.max_tokens}, got {self.min_tokens}.")
        # logprobs
        if self.logprobs is not None:
            if not _is_int(self.logprobs):
                raise ValueError(f"logprobs must be an integer or None, got "
                                 f"{type(self.logprobs).__name__}.")
            if self.logprobs != -1 and self.logprobs < 0:
                raise ValueError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
            if self.logprobs > MAX_INT:
                raise ValueError(f"logprobs must be at most {MAX_INT} (-1: the whole vocabulary), got {self.logprobs}.")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_PROMPT_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer in [0, {MAX_PROMPT_LOGPROBS}] or None, got "
                             f"{self.prompt_logprobs!r:.40}.")
        # seed
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {type(self.seed).__name__}.")
        # stop / stop_token_ids
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                             f"{len(self.stop_token_ids)}.")
        if not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must contain only integers, got {self.stop_token_ids!r:.200}.")
        if any(not 0 <= t <= MAX_INT for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must contain only integers in [0, {MAX_INT}], got "
                f"{self.stop_token_ids!r:.200}.")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}.")
        if not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must contain only strings, got {ascii(self.stop):.200}.")
        if any(not s for s in self.stop):
            raise ValueError("stop cannot contain an empty string.")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise ValueError(f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters long.")
        if any(bad_text(s) for s in self.stop):
            raise ValueError("stop strings must be valid text (UTF-8 cannot carry a lone surrogate).")
        # logit adjustments
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id to bias, got {type(self.logit_bias).__name__}.")
            if len(self.logit_bias) > MAX_TOKEN_IDS:
                raise ValueError(f"logit_bias may hold at most {MAX_TOKEN_IDS} tokens, got {len(self.logit_bias)}.")
            for t, b in self.logit_bias.items():
                if not _is_int(t) or not 0 <= t <= MAX_INT:
                    raise ValueError(f"logit_bias keys must be token ids (integers in [0, {MAX_INT}]), got {t!r:.80}.")
                if not _is_real(b) or not _finite(b):
                    raise ValueError(f"logit_bias[{t}] must be a finite number, got {b!r:.80}.")
        if self.allowed_token_ids is not None:
            if isinstance(self.allowed_token_ids, (str, bytes, dict)) or not isinstance(self.allowed_token_ids,
                                                                                      (list, tuple, set, frozenset)):
                raise ValueError(f"allowed_token_ids must be a list of token ids, got "
                                 f"{type(self.allowed_token_ids).__name__}.")
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids cannot be empty (leave it out to allow every token).")
            if len(self.allowed_token_ids) > MAX_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids may hold at most {MAX_TOKEN_IDS} ids.")
            if not all(_is_int(t) and 0 <= t <= MAX_INT for t in self.allowed_token_ids):
                raise ValueError(f"allowed_token_ids must contain only integers in [0, {MAX_INT}], got "
                                 f"{list(self.allowed_token_ids)!r:.200}.")
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or not isinstance(self.bad_words, (list, tuple)):
                raise ValueError(f"bad_words must be a list of strings, got {type(self.bad_words).__name__}.")
            if len(self.bad_words) > MAX_STOP_STRINGS:
                raise ValueError(f"bad_words may hold at most {MAX_STOP_STRINGS} words, got {len(self.bad_words)}.")
            if not all(isinstance(w, str) and w.strip() and len(w) <= MAX_STOP_STRING_CHARS and not bad_text(w)
                       for w in self.bad_words):
                raise ValueError(f"bad_words must hold non-blank strings of at most {MAX_STOP_STRING_CHARS} "
                                 f"characters (valid text), got {ascii(self.bad_words):.200}.")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                                 f"{type(self.structured_outputs).__name__}.")
            # The grammar decides where the output may end: EOS must stay its to allow.
            if self.ignore_eos is True:
                raise ValueError("ignore_eos cannot be used with structured_outputs (the grammar allows EOS only "
                                 "where the output may end).")
            if _is_int(self.min_tokens) and self.min_tokens > 0:
                raise ValueError("min_tokens cannot be used with structured_outputs (the grammar allows EOS only "
                                 "where the output may end).")
        # flags
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}.")

    # ------------------------------------------------------------------ helpers
    @property
    def num_children(self) -> int:
        """The completions generated: best_of, or n."""
        return self.best_of or self.n

    @property
    def ranks_children(self) -> bool:
        """More are generated than returned: the cumulative logprobs choose."""
        return self.best_of is not None and self.best_of > self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a streaming caller must hold back so that a stop string that may still be
        completing never reaches the user (vLLM's ``output_text_buffer_length``)."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def for_workers(self, eos_token_ids=()) -> RequestSampling:
        """What the workers sample this request with: greedy as temperature 0, top-k off as 0,
        the seed reduced to its low 64 bits as a signed int64 (what the workers' draws use), so
        that any Python int travels in the step's msgpack, and the tokens min_tokens bars (the
        model's `eos_token_ids` unless ignore_eos, and stop_token_ids)."""
        seed = self.seed
        if seed is not None and not (_INT64_MIN <= seed <= _INT64_MAX):
            seed &= _MASK64
            if seed >= 1 << 63:
                seed -= 1 << 64
        return RequestSampling(temperature=0.0 if self.is_greedy else self.temperature,
                               top_k=max(self.top_k, 0), top_p=self.top_p, min_p=self.min_p,
                               presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                               repetition_penalty=self.repetition_penalty, seed=seed, logprobs=self.logprobs,
                               logit_bias=tuple(sorted((self.logit_bias or {}).items())),
                               allowed_token_ids=tuple(self.allowed_token_ids or ()), min_tokens=self.min_tokens,
                               stop_ids=tuple(sorted({*self.stop_token_ids,
                                                      *(() if self.ignore_eos else eos_token_ids)}))
                               if self.min_tokens else (),
                               bad_words=tuple(tuple(w) for w in self.bad_words_token_ids or ()),
                               prompt_logprobs=self.prompt_logprobs)

    def tokenize_bad_words(self, tokenizer) -> None:
        """`bad_words_token_ids` from `bad_words`, as vLLM's `update_from_tokenizer`: each word
        (leading spaces stripped) encoded as is, and with one leading space where that gives the
        same number of tokens and another first token (a word inside the text)."""
        if not self.bad_words:
            self.bad_words_token_ids = None
            return
        if tokenizer is None:
            raise ValueError("bad_words needs the model's tokenizer (this model has none)")
        out: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            for ids in (plain, spaced) if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else (plain,):
                if not 0 < len(ids) <= MAX_BAD_WORD_TOKENS:
                    raise ValueError(f"bad_words: {word!r:.60} is {len(ids)} tokens; at most {MAX_BAD_WORD_TOKENS}")
                out.append(list(ids))
        self.bad_words_token_ids = out

    def clone(self) -> "SamplingParams":
        p = SamplingParams(**{f.name: (list(v) if isinstance(v := getattr(self, f.name), list)
                                       else dict(v) if isinstance(v, dict) else v) for f in fields(self) if f.init})
        if self.structured_outputs is not None:
            p.structured_outputs = copy.deepcopy(self.structured_outputs)
        p.bad_words_token_ids = self.bad_words_token_ids
        return p
