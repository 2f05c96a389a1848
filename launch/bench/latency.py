"""`distengine bench latency`: the time to generate one batch, as vLLM's `bench latency` (random
prompts of --input-len tokens, --output-len tokens each, ignoring EOS), against the roofline and
optionally transformers' generate() on the same weights, measured in the same run.

Per batch size it prints the whole batch's latency, the decode step (the median of the steps in
which every sequence decodes) and the output tokens per second, each beside its roofline and the
ratio. `--batch-size` takes several sizes, run on one engine. `--n` gives each prompt n
completions (sampled at temperature 1, as vLLM's), which share the prompt's blocks: with
`--output-len 1` the latency is the time to every completion's first token. The KV blocks held at
the timed iterations' peak are printed too (a shared prompt counts once).
"""
from __future__ import annotations

import time

from launch.bench import common as bc


def add_arguments(p) -> None:
    bc.add_model_arguments(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[8], help="one or more (default: 8)")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (default: %(default)s)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt (default: %(default)s)")
    p.add_argument("--num-iters-warmup", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--num-iters", type=int, default=5, help="timed iterations (default: %(default)s)")


def _check(args) -> None:
    for name in ("input_len", "output_len", "num_iters", "n"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.num_iters_warmup < 0 or any(b < 1 for b in args.batch_size):
        raise ValueError("--num-iters-warmup must be >= 0 and every --batch-size >= 1")


def run(args) -> int:
    from distengine import SamplingParams
    _check(args)
    model = bc.resolve_model(args)
    dev = "cuda" if bc.has_cuda(args.device) else "cpu"
    vocab = _vocab(model)
    hf = {}
    if args.hf:
        for b in args.batch_size:
            hf[b] = bc.hf_generate(model, bc.random_prompts(vocab, b, args.input_len, args.seed), args.output_len, dev)
    results = []
    with bc.make_llm(args, model, args.input_len + args.output_len) as llm:
        rf = bc.roofline_of(llm)
        bandwidth, matmul = rf.bandwidth, rf.matmul
        params = SamplingParams(n=args.n, temperature=0.0 if args.n == 1 else 1.0, max_tokens=args.output_len,
                                ignore_eos=True)
        for b in args.batch_size:
            # Fresh prompts every iteration: repeated ones would be served by the prefix cache.
            batches = [bc.random_prompts(vocab, b, args.input_len, args.seed + 1000 * (i + 1) + b)
                       for i in range(args.num_iters_warmup + args.num_iters)]
            for prompts in batches[:args.num_iters_warmup]:
                llm.generate(prompts, params, use_tqdm=False)
            log: list = []
            llm.engine.step_log = log
            llm.scheduler.peak_kv_usage = 0.0  # the timed iterations' own peak
            latencies = []
            for prompts in batches[args.num_iters_warmup:]:
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                latencies.append(time.perf_counter() - t)
            llm.engine.step_log = None
            seqs = b * args.n  # the prompt is computed once, each completion decodes
            step = bc.median(bc.decode_steps(log, seqs))
            mean_ctx = args.input_len + args.output_len // 2
            roof_step = rf.decode_step_s([mean_ctx] * seqs)
            roof_lat = rf.prefill_s(b * args.input_len) + rf.decode_s(seqs, args.input_len, args.output_len)
            lat = sum(latencies) / len(latencies)
            results.append(dict(batch_size=b, n=args.n, input_len=args.input_len, output_len=args.output_len,
                                avg_latency=lat, latencies=latencies, decode_step_s=step,
                                roofline_decode_step_s=roof_step, roofline_latency=roof_lat,
                                output_tok_s=seqs * args.output_len / lat,
                                roofline_output_tok_s=seqs * args.output_len / roof_lat,
                                decode_tok_s=seqs / step, roofline_decode_tok_s=seqs / roof_step,
                                hf_output_tok_s=hf.get(b),
                                peak_kv_blocks=round(llm.scheduler.peak_kv_usage * (llm.info.num_blocks - 1))))
        info = bc.engine_summary(llm.info)
    device = info["device_name"]
    print(f"\n{device}, TP={args.tensor_parallel_size}; model {model}; in {args.input_len} / out {args.output_len}"
          f"{f' x n={args.n}' if args.n > 1 else ''}; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, bf16 product {matmul / 1e12:.0f} TFLOP/s (same run); "
          f"weights per rank {info['weight_bytes'] / 1e9:.2f} GB as stored"
          f"{_stored_format(info['quantization'], model)}; KV cache "
          f"{info['kv_cache_dtype']} ({rf.kv_dtype_bytes} B an element, as the roofline counts it); "
          f"CUDA graphs: {bool(info['cuda_graphs'])}")
    rows = [("batch / figure", "ours", "roofline", "ours/roofline")]
    for r in results:
        b = r["batch_size"]
        rows += [(f"B={b} latency (s)", f"{r['avg_latency']:.3f}", f"{r['roofline_latency']:.3f}",
                  f"{r['roofline_latency'] / r['avg_latency']:.2f}"),
                 (f"B={b} decode step (ms)", f"{r['decode_step_s'] * 1e3:.2f}", f"{r['roofline_decode_step_s'] * 1e3:.2f}",
                  f"{r['roofline_decode_step_s'] / r['decode_step_s']:.2f}"),
                 (f"B={b} output tok/s", f"{r['output_tok_s']:.1f}", f"{r['roofline_output_tok_s']:.1f}",
                  f"{r['output_tok_s'] / r['roofline_output_tok_s']:.2f}"),
                 (f"B={b} decode tok/s", f"{r['decode_tok_s']:.1f}", f"{r['roofline_decode_tok_s']:.1f}",
                  f"{r['decode_tok_s'] / r['roofline_decode_tok_s']:.2f}")]
        rows.append((f"B={b} peak KV blocks held", f"{r['peak_kv_blocks']}", "", ""))
        if r["hf_output_tok_s"]:
            rows.append((f"B={b} HF generate tok/s", f"{r['hf_output_tok_s']:.1f}", "",
                         f"ours {r['output_tok_s'] / r['hf_output_tok_s']:.2f}x"))
    bc.print_table(rows)
    if bc.routing_note(rf):
        print(bc.routing_note(rf))
    bc.write_json(args.output_json, dict(kind="latency", device=device, tp=args.tensor_parallel_size, model=model,
                                         copy_bandwidth=bandwidth, matmul_rate=matmul, engine=info, results=results))
    return 0


def _stored_format(option: str | None, model: str) -> str:
    """What the weights' stored bytes are, beside the model dtype: the checkpoint's quant_method."""
    from distengine.hf_config import read_model_config
    from distengine.quantization import quantization_dict
    quant = quantization_dict(read_model_config(model).to_dict())
    method = option or (quant or {}).get("quant_method")
    return f" ({method}-quantized)" if method else ""


def _vocab(model: str) -> int:
    from distengine.hf_config import read_model_config
    return int(read_model_config(model).get_text_config().vocab_size)
