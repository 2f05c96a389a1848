"""What structured outputs cost: the same batch of requests with and without a JSON schema, in one
run, through `LLM.generate` (all at once, as `bench throughput`).

    python -m launch.bench.structured [--shape gemma-3-12b] [--num-prompts 128] [--input-len 512]
                                      [--output-len 128] [--load-format dummy] [--device cuda]

The random model gets a synthetic byte-level tokenizer of --vocab tokens (Gemma's 262,144 by
default): the grammar library's masks are as wide as a real tokenizer's, and every text a schema
allows can be spelled. Per library (`--backends`, each request naming its library), in one engine,
--pairs times: the batch with the schema (greedy with a frequency penalty; a request ends where its JSON
does or at --output-len), then the same prompts without it, each request generating exactly as
many tokens as its JSON run did: the same tokens in both, so their times compare as output
throughput. Also the median decode step of each and the host's mask fill per step (the engine's
step log).
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
    p.add_argument("--pairs", type=int, default=2, help="schema / plain pairs timed per library (default: %(default)s)")
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
    def greedy(**kw):
        return SamplingParams(temperature=0.0, frequency_penalty=1.0, **kw)
    rows = []
    with LLM(folder, load_format=args.load_format, device=args.device, max_model_len=args.input_len + args.output_len,
             max_num_seqs=max(args.num_prompts, 8), async_scheduling=not args.no_async_scheduling) as llm:
        log = llm.engine.step_log = []

        def run(params):
            start = len(log)
            t = time.perf_counter()
            outs = llm.generate(prompts[:len(params)], params, use_tqdm=False)
            return [o.outputs[0] for o in outs], time.perf_counter() - t, log[start:]

        for backend in args.backends:  # warm-up: graphs, both libraries' tokenizers
            run([greedy(max_tokens=8, structured_outputs=StructuredOutputsParams(json=SCHEMA, backend=backend))] * 8)
        run([greedy(max_tokens=1)] * len(prompts))  # every timed run finds the prompts in the prefix cache alike
        for _ in range(args.pairs):
            for backend in args.backends:
                spec = StructuredOutputsParams(json=SCHEMA, backend=backend)
                outs, schema_s, steps = run([greedy(max_tokens=args.output_len, structured_outputs=spec)] * len(prompts))
                # The same batch without the schema: every request as long as its JSON run was.
                _, plain_s, plain_steps = run([greedy(max_tokens=len(o.token_ids), ignore_eos=True) for o in outs])
                fills = [r.mask_fill_s for r in steps if r.mask_fill_s > 0]
                rows.append((backend, sum(len(o.token_ids) for o in outs), schema_s, plain_s,
                             _median_ms(bc.decode_steps(steps, len(prompts))),
                             _median_ms(bc.decode_steps(plain_steps, len(prompts))), _median_ms(fills),
                             sum(_parses(o.text) for o in outs)))
        device = bc.engine_summary(llm.info)["device_name"]
    print(f"\n{args.shape} shape ({args.load_format} weights), a {args.vocab}-token synthetic tokenizer, "
          f"{args.num_prompts} requests of {args.input_len} prompt tokens, up to {args.output_len} out, greedy; {device}")
    print("each JSON-schema batch, then the same batch without it (every request as long as its JSON run: "
          "the same tokens); steps: median of the full batch's decode steps")
    print(f"{'library':>10} {'out tokens':>11} {'schema s':>9} {'plain s':>8} {'tok/s ratio':>12} "
          f"{'schema step ms':>15} {'plain step ms':>14} {'mask fill ms':>13} {'valid JSON':>11}")
    for backend, tokens, schema_s, plain_s, step, plain_step, fill, valid in rows:
        print(f"{backend:>10} {tokens:>11} {schema_s:>9.2f} {plain_s:>8.2f} {plain_s / schema_s:>12.3f} "
              f"{step:>15.2f} {plain_step:>14.2f} {fill:>13.2f} {valid:>11}")
    for backend in args.backends:
        best = max(r[3] / r[2] for r in rows if r[0] == backend)
        ratios = [r[3] / r[2] for r in rows if r[0] == backend]
        print(f"output tok/s with a schema ({backend}) / without: best {best:.3f}, median "
              f"{bc.median(ratios):.3f} of {len(ratios)} pairs")
    return 0


def _median_ms(values: list[float]) -> float:
    return bc.median(values) * 1e3 if values else float("nan")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
