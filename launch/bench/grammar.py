"""`python -m launch.bench.grammar`: the host's cost of structured outputs per step (CPU only).

The driver fills one bitmask per request with a grammar before each step that samples it
(`distengine.structured_outputs.fill_bitmasks`: one call, on the library's threads). This
times that fill for a batch of requests over a synthetic vocabulary of the size of today's large
ones (262,144 tokens: the 256 bytes, then random pieces of letters, digits, JSON punctuation and
spaces, seeded), every request in another state of one JSON schema (each has accepted a different
prefix of a valid document, byte by byte, and accepts its next byte each step, as the engine's
matchers do before they fill): with each library, xgrammar and llguidance, through the engine's
own matchers and `fill_bitmasks` (the bytes the step carries included), on the same vocabulary
and states; then the ratio of the two. Also the schema's compile time against that vocabulary.
"""
from __future__ import annotations

import argparse
import json
from importlib.metadata import version
import random
import statistics
import string
import time

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "age", "color", "tags"], "additionalProperties": False}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "color": "green",
                       "tags": ["math", "analytical engines", "poetry", "Bernoulli numbers", "notes", "looms"]})
ALPHABET = string.ascii_letters + string.digits + '{}[]":,.-_ ' + "    "


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    """The 256 single bytes, unique random pieces, and an EOS token last."""
    rng = random.Random(seed)
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    while len(tokens) < size - 1:
        t = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(2, 8))).encode()
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    return tokens + [b"<eos>"]


def starts(requests: int, repeats: int) -> list[int]:
    """Where each request starts in the document (its accepted prefix), room left for the steps."""
    room = len(DOCUMENT.encode()) - repeats
    return [(i * 7) % room for i in range(requests)]


def _timed(step, repeats: int) -> list[float]:
    """Each step: every request accepts its next byte, then its mask is filled (a library may keep
    the mask of a state it has seen: a new state each step is what the engine sees)."""
    out = []
    for k in range(repeats):
        t0 = time.perf_counter()
        step(k)
        out.append(time.perf_counter() - t0)
    return out


def _walk(grammars: list, requests: int, repeats: int):
    """Each request accepts its prefix of the document (token b is byte b); the step: every
    request accepts its next byte, then the engine's fill, as one decode step of the engine."""
    from distengine.structured_outputs import fill_bitmasks
    data, at = DOCUMENT.encode(), starts(requests, repeats)
    for g, start in zip(grammars, at):
        assert all(g.accept(b) for b in data[:start])

    accept_s: list[float] = []

    def step(k: int) -> None:
        t0 = time.perf_counter()
        for g, start in zip(grammars, at):
            assert g.accept(data[start + k])
        accept_s.append(time.perf_counter() - t0)
        fill_bitmasks(grammars)
    return _timed(step, repeats), accept_s


def bench_xgrammar(vocab: list[bytes], requests: int, repeats: int) -> dict:
    import xgrammar as xgr

    from distengine.sampling_params import StructuredOutputsParams
    from distengine.structured_outputs import XGrammarMatcher, _key
    eos = len(vocab) - 1
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])
    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled = compiler.compile_json_schema(_key(StructuredOutputsParams(json=SCHEMA))[1])
    compile_s = time.perf_counter() - t0
    grammars = [XGrammarMatcher(xgr.GrammarMatcher(compiled, override_stop_tokens=[eos]), len(vocab))
                for _ in range(requests)]
    times, accept = _walk(grammars, requests, repeats)
    return {"library": f"xgrammar {version('xgrammar')}", "compile_s": compile_s, "step_ms": [t * 1e3 for t in times],
            "accept_ms": [t * 1e3 for t in accept]}


def bench_llguidance(vocab: list[bytes], requests: int, repeats: int) -> dict:
    import llguidance

    from distengine.sampling_params import StructuredOutputsParams
    from distengine.structured_outputs import GuidanceMatcher, _guidance_grammar, _key
    eos = len(vocab) - 1

    class Tokens:  # what llguidance's TokenizerWrapper reads
        eos_token_id, bos_token_id, special_token_ids = eos, None, [eos]
        tokens = vocab

        def __call__(self, data: bytes) -> list[int]:
            return list(data)  # byte b is token b

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tokens()))
    grammar = _guidance_grammar(*_key(StructuredOutputsParams(json=SCHEMA)))  # the engine's reading
    t0 = time.perf_counter()
    compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    compile_s = time.perf_counter() - t0
    assert not compiled.is_error(), compiled.get_error()
    grammars = [GuidanceMatcher(compiled.deep_copy(), len(vocab), stops=frozenset({eos}), tokenizer_size=len(vocab))
                for _ in range(requests)]
    times, accept = _walk(grammars, requests, repeats)
    return {"library": f"llguidance {version('llguidance')}", "compile_s": compile_s,
            "step_ms": [t * 1e3 for t in times], "accept_ms": [t * 1e3 for t in accept]}


def add_arguments(p) -> None:
    p.add_argument("--vocab-size", type=int, default=262_144)
    p.add_argument("--requests", type=int, default=128, help="requests with a grammar in one step")
    p.add_argument("--repeats", type=int, default=20, help="steps timed")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--threads", type=int, default=None,
                   help="the fill's threads per library (default: the engine's, MAX_FILL_THREADS or the cores)")


def run(args) -> int:
    import distengine.structured_outputs as so
    if args.threads is not None:  # before the libraries' pools are made (on first use)
        so.MAX_FILL_THREADS = args.threads
    vocab = synthetic_vocab(args.vocab_size)
    results = [bench_xgrammar(vocab, args.requests, args.repeats), bench_llguidance(vocab, args.requests, args.repeats)]
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"accept one token and fill the bitmask, for {args.requests} requests (one JSON schema, each in another state), "
          f"vocabulary of {len(vocab):,} tokens, through the engine's fill ({so._fill_threads()} threads per library); "
          f"{args.repeats} steps")
    for r in results:
        ms = r["step_ms"]
        print(f"  {r['library']:<18} median {statistics.median(ms):8.2f} ms/step (min {min(ms):.2f}, first "
              f"{ms[0]:.2f}; {statistics.median(ms) * 1e3 / args.requests:.0f} us/request), of which accepting "
              f"the tokens {statistics.median(r['accept_ms']):.2f} ms; compile {r['compile_s']:.2f} s")
    xg, ll = (statistics.median(r["step_ms"]) for r in results)
    print(f"  xgrammar / llguidance: {xg / ll:.2f}x the time per step")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
