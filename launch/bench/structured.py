"""What structured outputs cost: the same batch of requests with and without a JSON schema, in one
run, through `LLM.generate` (all at once, as `bench throughput`).

    python -m launch.bench.structured [--shape gemma-3-12b] [--num-prompts 128] [--input-len 512]
                                      [--output-len 128] [--load-format dummy] [--device cuda]

The random model gets a synthetic byte-level tokenizer of --vocab tokens (Gemma's 262,144 by
default): the grammar library's masks are as wide as a real tokenizer's, and every text a schema
allows can be spelled. The batches, unconstrained and one with the schema per library (`--backends`,
each request naming its library), run in one engine, twice each, greedy (with a frequency
penalty), `ignore_eos` off, on the same prompts; a schema's request ends where its JSON does, so
the figures compared are output tokens per second and the median decode step, not the wall time
of the batch.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time

from launch.bench import common as bc

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}},
                         "kind": {"enum": ["person", "company", "place"]},
                         "scores": {"type": "array", "items": {"type": "number"}}},
          "required": ["name", "age", "tags", "kind", "scores"]}


def save_synthetic_tokenizer(folder: str, vocab: int, eos_id: int, seed: int = 0) -> None:
    """A byte-level BPE tokenizer of `vocab` tokens: the special tokens below `eos_id` + 1, the 256
    byte symbols, then distinct random pieces of 2 to 8 symbols (letters, digits, punctuation,
    spaces). The pieces have no merges, so prompts encode byte by byte; generation may emit any."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    symbols = pre_tokenizers.ByteLevel.alphabet()
    special = [f"<special_{i}>" for i in range(eos_id)] + ["<eos>"]
    table = {t: i for i, t in enumerate(special)}
    for s in sorted(symbols):
        table.setdefault(s, len(table))
    rng = random.Random(seed)
    common = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789" + "Ġ" * 8 + '",:{}[]._-'
    while len(table) < vocab:
        piece = "".join(rng.choice(common) for _ in range(rng.randint(2, 8)))
        table.setdefault(piece, len(table))
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(folder)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="gemma-3-12b", choices=sorted(bc.SHAPES))
    p.add_argument("--model-dir", default=None)
    p.add_argument("--vocab", type=int, default=262144, help="the synthetic tokenizer's tokens")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--device", default="auto")
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--backends", nargs="+", default=["xgrammar", "guidance"], choices=["xgrammar", "guidance"],
                   help="the libraries whose schema runs are timed, each in the same engine (default: both)")
    args = p.parse_args()
    from distengine import LLM, SamplingParams, StructuredOutputsParams
    from distengine.hf_config import load_hf_config
    folder = args.model_dir or os.path.join(os.path.expanduser("~"), ".cache", "distengine", f"bench-{args.shape}-so")
    if not os.path.exists(os.path.join(folder, "config.json")):
        bc.build_random_model(folder, args.shape, args.device, weights=args.load_format != "dummy")
    if not os.path.exists(os.path.join(folder, "tokenizer.json")):
        cfg = load_hf_config(folder)
        eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id[0]
        save_synthetic_tokenizer(folder, min(args.vocab, cfg.vocab_size), int(eos))
    prompts = bc.random_prompts(min(args.vocab, load_hf_config(folder).vocab_size), args.num_prompts, args.input_len, 0)
    # A penalty in both runs: random weights under a grammar that allows free whitespace would
    # otherwise repeat a blank forever.
    plain = SamplingParams(temperature=0.0, frequency_penalty=1.0, max_tokens=args.output_len)
    schemas = {f"schema, {b}": SamplingParams(temperature=0.0, frequency_penalty=1.0, max_tokens=args.output_len,
                                              structured_outputs=StructuredOutputsParams(json=SCHEMA, backend=b))
               for b in args.backends}
    runs = [("unconstrained", plain), *schemas.items()]
    rows = []
    with LLM(folder, load_format=args.load_format, device=args.device, max_model_len=args.input_len + args.output_len,
             max_num_seqs=max(args.num_prompts, 8), async_scheduling=not args.no_async_scheduling) as llm:
        llm.engine.step_log = []
        for name, sp in [("warm-up", sp) for _, sp in runs] + runs + runs:
            n = len(prompts) if name != "warm-up" else 8
            log_start = len(llm.engine.step_log)
            t = time.perf_counter()
            outs = llm.generate(prompts[:n], sp, use_tqdm=False)
            elapsed = time.perf_counter() - t
            if name == "warm-up":
                continue
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            valid = sum(_parses(o.outputs[0].text) for o in outs) if sp is not plain else None
            steps = bc.decode_steps(llm.engine.step_log[log_start:], n)
            rows.append((name, tokens, elapsed, tokens / elapsed, bc.median(steps) * 1e3 if steps else float("nan"),
                         len(steps), valid))
        device = bc.engine_summary(llm.info)["device_name"]
    print(f"\n{args.shape} shape ({args.load_format} weights), a {args.vocab}-token synthetic tokenizer, "
          f"{args.num_prompts} requests of {args.input_len} prompt tokens, up to {args.output_len} out, greedy; {device}")
    print(f"{'run':>20} {'out tokens':>11} {'seconds':>8} {'out tok/s':>10} {'median step ms':>15} {'steps':>6} "
          f"{'valid JSON':>10}")
    for name, tokens, elapsed, rate, step, steps, valid in rows:
        print(f"{name:>20} {tokens:>11} {elapsed:>8.2f} {rate:>10.1f} {step:>15.2f} {steps:>6} "
              f"{'' if valid is None else valid:>10}")
    base = max(r[3] for r in rows if r[0] == "unconstrained")
    for name in schemas:
        best = max(r[3] for r in rows if r[0] == name)
        print(f"output tok/s with a schema ({name.split(', ')[1]}) / without: {best / base:.3f} (best of two runs each)")
    return 0


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
