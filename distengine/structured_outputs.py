"""Structured outputs with two libraries, xgrammar and llguidance: a request's
`StructuredOutputsParams` as a grammar of one of them, compiled against the model's tokenizer, and
a matcher per request that says which tokens may come next.

Which library serves a spec (`library_for`): the one the request names (`backend`), else the
engine's `structured_outputs_backend`; "auto" gives llguidance the JSON schemas, JSON objects,
regexes and choices, whose meaning does not depend on the library and whose bitmasks it filled
in half xgrammar's time in a served batch (docs/performance.md), and xgrammar the grammars (EBNF,
as vLLM's default backend reads them; llguidance reads a grammar as Lark, as vLLM's "guidance"
backend does).

Everything here runs on the driver, beside the scheduler (`EngineCore`): the scheduler advances a
request's matcher with each token the workers sampled (`RequestGrammar.accept`) and, for a step
in which the request samples, sends the workers its bitmask (`StepPlan.grammar_masks`), which the
sampler applies before anything else. Each library's view of the tokenizer is built once per
engine, on the first request that needs it; compiled grammars are kept by their spec, an LRU per
library, so that many requests with one schema compile it once.

The front ends check a spec without the tokenizer first (`check`: the schema, regex or grammar
parses for its library), so that a bad one is a ValueError (HTTP 400) before anything is queued.
"""
from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from distengine.config import STRUCTURED_OUTPUTS_BACKENDS
from distengine.sampling_params import StructuredOutputsParams

LIBRARIES = ("xgrammar", "guidance")  # the backends' names for them (vLLM's)
NAMES = {"xgrammar": "xgrammar", "guidance": "llguidance"}  # as the messages name them
MAX_COMPILED = 256  # compiled grammars kept per library per engine
MAX_FILL_THREADS = 8  # the bitmask fill's threads (the workers need cores of their own)
WHAT = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
        "json_object": "JSON object grammar"}


def library_for(spec: StructuredOutputsParams, backend: str = "auto") -> str:
    """The library that serves `spec` on an engine whose `structured_outputs_backend` is
    `backend`: the request's own choice first; "auto" gives grammars to xgrammar (EBNF) and the
    rest to llguidance."""
    chosen = spec.backend if spec.backend not in (None, "auto") else backend
    if chosen not in STRUCTURED_OUTPUTS_BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                         f"got {chosen!r:.40}")
    if chosen == "auto":
        return "xgrammar" if spec.kind == "grammar" else "guidance"
    return chosen


def _key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): the spec as text, the same for either library (a choice as its JSON list)."""
    kind = spec.kind
    if kind == "json":
        if isinstance(spec.json, str):
            return kind, spec.json
        try:
            return kind, json.dumps(spec.json)  # (not sorted: its key order is the output's)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json: the schema is not JSON: {e}") from None
    if kind == "choice":
        return kind, json.dumps(spec.choice, ensure_ascii=False)
    return kind, "" if kind == "json_object" else getattr(spec, kind)


def _refused(library: str, kind: str, e: Exception | str) -> ValueError:
    message = str(e).strip()
    # xgrammar's messages start with a time and its source file: the reason is what follows.
    message = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", message)
    # llguidance's end with the grammar's line and a caret under the place: the reason alone.
    message = " ".join(line.strip() for line in message.splitlines()
                       if line.strip().strip("^") and not re.match(r"\s*\d+ \|", line))
    return ValueError(f"structured_outputs.{kind}: {NAMES[library]} cannot compile this {WHAT[kind]}: {message}")


# ---- each library's reading of a spec ---------------------------------------------------------
def _xgrammar_grammar(kind: str, text: str):
    """The spec as xgrammar's grammar (parsing it checks it; compiled against a vocabulary later)."""
    import xgrammar as xgr
    if kind == "json":
        json.loads(text)  # the library's own message for bad JSON text is less clear
        return xgr.Grammar.from_json_schema(text)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}')  # an object, as vLLM's
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":  # JSON string literals are EBNF string literals (the same escapes)
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                              for c in json.loads(text)))
    return xgr.Grammar.from_ebnf(text)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("enum", "const", "default", "examples")


def _closed_objects(schema):
    """`schema` with `"additionalProperties": false` in every object schema that lists properties
    and says nothing of others: a schema as xgrammar reads it (strict), and vLLM's guidance backend
    with disable_additional_properties, so that it means the same under either library (a bare
    `{"type": "object"}` still allows any object)."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # names to schemas (not a schema itself)
            out[key] = {name: _closed_objects(s) for name, s in value.items()}
        elif key in _SCHEMA_VALUES:  # JSON values, not schemas
            out[key] = value
        else:
            out[key] = _closed_objects(value)
    if ("properties" in out or "patternProperties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _guidance_grammar(kind: str, text: str) -> str:
    """The spec as llguidance's grammar (its JSON text; `_guidance_checked` checks it), as vLLM's
    guidance backend writes it: JSON with flexible whitespace and objects closed as xgrammar reads
    them (`_closed_objects`), a grammar as Lark (or GBNF, which llguidance converts)."""
    import llguidance as llg
    if kind in ("json", "json_object"):
        schema = json.dumps(_closed_objects(json.loads(text))) if kind == "json" else '{"type": "object"}'
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    return llg.grammar_from("choice" if kind == "choice" else "grammar", text)


def _guidance_checked(kind: str, text: str, tokenizer=None) -> str:
    import llguidance as llg
    grammar = _guidance_grammar(kind, text)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ValueError(messages[0] if messages else "invalid grammar")
    return grammar


def _read(library: str, kind: str, text: str):
    """The spec as `library`'s grammar; raises what the library raises when it cannot be."""
    return _xgrammar_grammar(kind, text) if library == "xgrammar" else _guidance_checked(kind, text)


def check(spec: StructuredOutputsParams, backend: str = "auto") -> None:
    """The spec parses for the library that would serve it on an engine whose
    `structured_outputs_backend` is `backend` (a ValueError naming its field, the library and
    its message if not)."""
    library = library_for(spec, backend)
    kind, text = _key(spec)
    try:
        _read(library, kind, text)
    except Exception as e:  # noqa: BLE001 - the libraries raise RuntimeError, ValueError and others
        raise _refused(library, kind, e) from None


# ---- a request's matcher --------------------------------------------------------------------
@dataclass(eq=False)
class RequestGrammar:
    """One request's matcher and the output tokens it has accepted; one interface over either
    library (`XGrammarMatcher`, `GuidanceMatcher`)."""
    matcher: object
    vocab_size: int  # the model's: the bitmask's width
    num_accepted: int = 0
    library = ""

    def accept(self, token: int) -> bool:
        """False: the grammar does not allow it (the matcher is left as it was)."""
        if not self._accept(token):
            return False
        self.num_accepted += 1
        return True

    def _accept(self, token: int) -> bool:
        raise NotImplementedError

    @property
    def terminated(self) -> bool:
        """It accepted a stop token (the output is complete)."""
        raise NotImplementedError

    @classmethod
    def fill(cls, grammars: list[RequestGrammar], rows: list[int], masks: np.ndarray) -> None:
        """Each grammar's next bitmask into its row of `masks`, in one call on the library's threads."""
        raise NotImplementedError


def _fill_threads() -> int:
    return max(1, min(MAX_FILL_THREADS, os.cpu_count() or 1))


_xgrammar_batch = None  # the libraries' thread pools for filling many masks at once, made on first use
_guidance_executor = None


class XGrammarMatcher(RequestGrammar):
    """xgrammar's `GrammarMatcher`; its stop tokens (EOS and the request's) are the matcher's own
    (`override_stop_tokens`)."""
    library = "xgrammar"

    def _accept(self, token: int) -> bool:
        return self.matcher.accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    @classmethod
    def fill(cls, grammars, rows, masks) -> None:
        global _xgrammar_batch
        import torch
        import xgrammar as xgr
        if _xgrammar_batch is None:
            _xgrammar_batch = xgr.BatchGrammarMatcher(max_threads=_fill_threads())
        _xgrammar_batch.batch_fill_next_token_bitmask([g.matcher for g in grammars], torch.from_numpy(masks), rows)


@dataclass(eq=False)
class GuidanceMatcher(RequestGrammar):
    """llguidance's `LLMatcher`. Its tokenizer's EOS tokens are the engine's; the request's other
    stop tokens (`extra_stops`) are handled here the same way: allowed exactly when the grammar
    may end, and accepting one (or EOS) terminates. `tokenizer_size`: the tokenizer's tokens
    (those past it, up to the model's vocabulary, are never allowed)."""
    stops: frozenset[int] = frozenset()
    extra_stops: tuple[int, ...] = ()
    tokenizer_size: int = 0
    _terminated: bool = False
    library = "guidance"

    def _accept(self, token: int) -> bool:
        if self._terminated:
            return False
        if token in self.stops:
            if not self.matcher.is_accepting():
                return False
            self._terminated = True
            return True
        # (try_consume_tokens leaves the matcher as it was when it refuses; consume_token would not)
        return self.matcher.try_consume_tokens([token]) == 1

    @property
    def terminated(self) -> bool:
        return self._terminated

    @classmethod
    def fill(cls, grammars, rows, masks) -> None:
        global _guidance_executor
        import llguidance as llg
        import llguidance.numpy as lln
        if _guidance_executor is None:
            _guidance_executor = llg.LLExecutor(num_threads=_fill_threads())
        lln.fill_next_token_bitmask_par(_guidance_executor, [(g.matcher, row) for g, row in zip(grammars, rows)],
                                        masks)
        words = masks.view(np.uint32)
        for g, row in zip(grammars, rows):
            if g.tokenizer_size < g.vocab_size:  # the padded vocabulary: never allowed
                full, rest = divmod(g.tokenizer_size, 32)
                if rest:
                    words[row, full] &= np.uint32((1 << rest) - 1)
                words[row, full + bool(rest):] = 0
            if g.extra_stops:
                ends = g.matcher.is_accepting()
                for t in g.extra_stops:
                    bit = np.uint32(1 << (t % 32))
                    words[row, t // 32] = (words[row, t // 32] | bit) if ends else (words[row, t // 32] & ~bit)


def fill_bitmasks(grammars: list[RequestGrammar]) -> list[bytes]:
    """Each matcher's next bitmask (bit set: allowed; int32 words of 32 tokens, little-endian,
    ceil(vocab_size / 32) of them), as the step carries them, in the order given. The rows of
    each library are filled in one call on its threads (up to MAX_FILL_THREADS): filled one
    after another, 128 masks over a 262k vocabulary took ~25 ms a step with xgrammar on this
    2-core machine, against a decode step of ~16 ms on an H200."""
    masks = np.zeros((len(grammars), -(-grammars[0].vocab_size // 32)), dtype=np.int32)
    groups: dict[type, list[int]] = {}
    for i, g in enumerate(grammars):
        groups.setdefault(type(g), []).append(i)
    for cls, rows in groups.items():
        cls.fill([grammars[i] for i in rows], rows, masks)
    rest = grammars[0].vocab_size % 32
    if rest:  # the last word's bits past the vocabulary (xgrammar sets them): none
        masks.view(np.uint32)[:, -1] &= np.uint32((1 << rest) - 1)
    return [row.tobytes() for row in masks]


# ---- per engine: the tokenizer as each library reads it, and the compiled grammars -----------
@dataclass(eq=False)
class GrammarCompiler:
    """Per engine: the tokenizer's vocabulary as each library reads it (built on first use), and
    the compiled grammars by spec (an LRU per library). `vocab_size`: the model's (may be padded
    past the tokenizer's; those tokens are never allowed). `backend`: the engine's
    `structured_outputs_backend`."""
    tokenizer: object
    vocab_size: int
    eos_token_ids: frozenset[int]
    backend: str = "auto"
    _xgrammar: object = None   # xgrammar.GrammarCompiler
    _guidance: object = None   # llguidance.LLTokenizer
    _compiled: dict = field(default_factory=lambda: {name: OrderedDict() for name in LIBRARIES})

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
                             f"got {self.backend!r:.40}")

    def _need_tokenizer(self) -> None:
        if self.tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer (this model has none)")

    def _xgrammar_compiler(self):
        if self._xgrammar is None:
            import xgrammar as xgr
            self._need_tokenizer()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=sorted(self.eos_token_ids) or None)
            self._xgrammar = xgr.GrammarCompiler(info, max_threads=1)
        return self._xgrammar

    def _guidance_tokenizer(self):
        if self._guidance is None:
            import llguidance.hf
            self._need_tokenizer()
            eos = sorted(self.eos_token_ids) or None
            self._guidance = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
        return self._guidance

    def library(self, spec: StructuredOutputsParams) -> str:
        return library_for(spec, self.backend)

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec` for its library (a ValueError naming its field and the
        library when it cannot be): xgrammar's `CompiledGrammar`, or for llguidance a matcher in
        its start state, which each request's matcher copies."""
        library = self.library(spec)
        key = _key(spec)
        cache = self._compiled[library]
        got = cache.get(key)
        if got is not None:
            cache.move_to_end(key)
            return got
        kind, text = key
        if library == "xgrammar":
            compiler = self._xgrammar_compiler()
            try:
                compiled = compiler.compile_grammar(_xgrammar_grammar(kind, text))
            except Exception as e:  # noqa: BLE001 - the library raises RuntimeError and others
                raise _refused(library, kind, e) from None
        else:
            import llguidance as llg
            tokenizer = self._guidance_tokenizer()
            try:
                compiled = llg.LLMatcher(tokenizer, _guidance_grammar(kind, text), log_level=0)
            except Exception as e:  # noqa: BLE001
                raise _refused(library, kind, e) from None
            if compiled.is_error():
                raise _refused(library, kind, compiled.get_error())
        cache[key] = compiled
        if len(cache) > MAX_COMPILED:
            cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams, stop_token_ids) -> RequestGrammar:
        """A new request's matcher: the grammar may end with EOS or any of its stop tokens."""
        compiled = self.compile(spec)
        stops = sorted({*self.eos_token_ids, *stop_token_ids})
        if self.library(spec) == "guidance":
            return GuidanceMatcher(compiled.deep_copy(), self.vocab_size, stops=frozenset(stops),
                                   extra_stops=tuple(t for t in stops if t not in self.eos_token_ids),
                                   tokenizer_size=min(self.vocab_size, len(self.tokenizer)))
        import xgrammar as xgr
        return XGrammarMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None), self.vocab_size)
