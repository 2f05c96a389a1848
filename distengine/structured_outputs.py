"""Structured outputs with xgrammar: a request's `StructuredOutputsParams` as a grammar, compiled
against the model's tokenizer, and a matcher per request that says which tokens may come next.

Everything here runs on the driver, beside the scheduler (`EngineCore`): the scheduler advances a
request's matcher with each token the workers sampled (`RequestGrammar.accept`) and, when the
request samples again, sends the workers its bitmask (`ScheduledRequest.token_bitmask`), which the
sampler applies before anything else. The tokenizer's vocabulary is read once per engine, on the
first request that needs it; compiled grammars are kept by their spec (an LRU), so that many
requests with one schema compile it once.

The front ends check a spec without the tokenizer first (`check`: the schema, regex or grammar
parses), so that a bad one is a ValueError (HTTP 400) before anything is queued.
"""
from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field

from distengine.sampling_params import StructuredOutputsParams

LIBRARY = "xgrammar"
MAX_COMPILED = 256  # compiled grammars kept per engine
MAX_FILL_THREADS = 8  # the bitmask fill's threads (the workers need cores of their own)


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are EBNF string literals (the same escapes).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _schema_text(spec: StructuredOutputsParams) -> str:
    if isinstance(spec.json, str):
        return spec.json
    try:
        return json.dumps(spec.json)  # (not sorted: its key order is the output's)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json: the schema is not JSON: {e}") from None


def _key(spec: StructuredOutputsParams) -> tuple[str, str]:
    kind = spec.kind
    if kind == "json":
        return kind, _schema_text(spec)
    if kind == "choice":
        return kind, _choice_ebnf(spec.choice)
    return kind, "" if kind == "json_object" else getattr(spec, kind)


def _refused(kind: str, e: Exception) -> ValueError:
    what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
            "json_object": "JSON object grammar"}[kind]
    # The library's messages start with a time and its source file: the reason is what follows.
    message = re.sub(r"^\[[^\]]*\] \S+:\d+: ", "", str(e).strip())
    return ValueError(f"structured_outputs.{kind}: {LIBRARY} cannot compile this {what}: {message}")


def _grammar(kind: str, text: str):
    """The spec as the library's grammar (compiled against a vocabulary later)."""
    import xgrammar as xgr
    if kind == "json":
        json.loads(text)  # the library's own message for bad JSON text is less clear
        return xgr.Grammar.from_json_schema(text)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}')  # an object, as vLLM's
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    return xgr.Grammar.from_ebnf(text)  # grammar, choice


def check(spec: StructuredOutputsParams) -> None:
    """The spec parses (a ValueError naming its field and the library's message if not)."""
    kind, text = _key(spec)
    try:
        _grammar(kind, text)
    except Exception as e:  # noqa: BLE001 - the library raises RuntimeError and others
        raise _refused(kind, e) from None


@dataclass(eq=False)
class RequestGrammar:
    """One request's matcher and the output tokens it has accepted."""
    matcher: object  # xgrammar.GrammarMatcher
    vocab_size: int  # the model's: the bitmask's width
    num_accepted: int = 0

    def accept(self, token: int) -> bool:
        """False: the grammar does not allow it (the matcher is left as it was)."""
        if not self.matcher.accept_token(token):
            return False
        self.num_accepted += 1
        return True

    @property
    def terminated(self) -> bool:
        """It accepted a stop token (the output is complete)."""
        return self.matcher.is_terminated()


_batch_matcher = None  # the library's thread pool for filling many masks at once, made on first use


def fill_bitmasks(grammars: list[RequestGrammar]) -> list[bytes]:
    """Each matcher's next bitmask (bit set: allowed), as the step carries them. One call fills
    them all on the library's threads (its default, "auto", took one here): filled one after
    another, 128 masks over a 262k vocabulary took ~25 ms a step on this 2-core machine, ~12 ms
    on two threads, against a decode step of ~16 ms on an H200."""
    global _batch_matcher
    import xgrammar as xgr
    if _batch_matcher is None:
        _batch_matcher = xgr.BatchGrammarMatcher(max_threads=max(1, min(MAX_FILL_THREADS, os.cpu_count() or 1)))
    masks = xgr.allocate_token_bitmask(len(grammars), grammars[0].vocab_size)
    _batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], masks)
    rows = masks.numpy()
    return [row.tobytes() for row in rows]


@dataclass(eq=False)
class GrammarCompiler:
    """Per engine: the tokenizer's vocabulary as the library reads it (built on first use), and the
    compiled grammars by spec. `vocab_size`: the model's (may be padded past the tokenizer's; those
    tokens are never allowed)."""
    tokenizer: object
    vocab_size: int
    eos_token_ids: frozenset[int]
    _compiler: object = None
    _compiled: OrderedDict = field(default_factory=OrderedDict)

    def _library(self):
        if self._compiler is None:
            import xgrammar as xgr
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer (this model has none)")
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=sorted(self.eos_token_ids) or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec` (a ValueError naming its field when it cannot be)."""
        key = _key(spec)
        got = self._compiled.get(key)
        if got is not None:
            self._compiled.move_to_end(key)
            return got
        compiler = self._library()
        kind, text = key
        try:
            compiled = compiler.compile_grammar(_grammar(kind, text))
        except Exception as e:  # noqa: BLE001 - the library raises RuntimeError and others
            raise _refused(kind, e) from None
        self._compiled[key] = compiled
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams, stop_token_ids) -> RequestGrammar:
        """A new request's matcher: the grammar may end with EOS or any of its stop tokens."""
        import xgrammar as xgr
        compiled = self.compile(spec)
        stops = sorted({*self.eos_token_ids, *stop_token_ids})
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        return RequestGrammar(matcher, self.vocab_size)
