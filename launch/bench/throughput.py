"""`distengine bench throughput`: offline throughput over many prompts, as vLLM's `bench
throughput`: --num-prompts random prompts of --input-len tokens (or a dataset file), each
generating --output-len tokens (or the dataset's), all handed to `LLM.generate` at once.

Prints vLLM's line (requests/s, total tokens/s, output tokens/s) and the output tokens/s beside
the roofline (prefill products at the measured product rate, decode steps at the copy bandwidth;
requests run in waves of max_num_seqs) and the ratio; `--hf` adds transformers' generate() on the
same weights, all prompts in one batch. `--async-engine` (vLLM's flag) submits them to `AsyncLLM`
instead, the engine `distengine serve` runs, without HTTP.

A dataset file is JSON (a list) or JSON lines, one object per request: "prompt" (text; the model
needs a tokenizer) or "prompt_token_ids", and optionally "output_len".
"""
from __future__ import annotations

import json
import time

from launch.bench import common as bc


def add_arguments(p) -> None:
    bc.add_model_arguments(p)
    p.add_argument("--num-prompts", type=int, default=1000, help="(default: %(default)s)")
    p.add_argument("--input-len", type=int, default=512, help="random prompts' tokens (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (default: %(default)s)")
    p.add_argument("--dataset-path", default=None, help="JSON or JSON-lines requests instead of random ones")
    p.add_argument("--async-engine", action="store_true",
                   help="run the requests through AsyncLLM (the server's engine: its loop in a process of its own, "
                        "$DISTENGINE_ENGINE_PROCESS=0 for a thread; every request streamed) instead of LLM.generate")


def _llm_generate(llm, prompts: list[dict], params: list, tag: str) -> int:
    """The output tokens of `LLM.generate` over all requests at once."""
    return sum(len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False))


def _async_generate(engine, prompts: list[dict], params: list, tag: str) -> int:
    """The output tokens of all requests submitted to an `AsyncLLM` at once, each one's deltas
    consumed as a server consumes them."""
    import asyncio

    async def one(rid: str, prompt: dict, sp) -> int:
        n = 0
        async for out in engine.generate(prompt, sp, rid):
            n += len(out.outputs[0].token_ids)
        return n

    async def all_of_them() -> list[int]:
        return await asyncio.gather(*(one(f"{tag}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))))
    return sum(asyncio.run(all_of_them()))


def load_dataset(path: str, tokenizer, output_len: int, num_prompts: int) -> list[tuple[dict, int]]:
    with open(path) as f:
        text = f.read()
    try:
        rows = json.loads(text)
        rows = rows if isinstance(rows, list) else [rows]
    except json.JSONDecodeError:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for i, r in enumerate(rows[:num_prompts]):
        if not isinstance(r, dict) or not ("prompt" in r or "prompt_token_ids" in r):
            raise ValueError(f"{path}: request {i} needs 'prompt' or 'prompt_token_ids'")
        if "prompt_token_ids" in r:
            ids = [int(t) for t in r["prompt_token_ids"]]
        else:
            if tokenizer is None:
                raise ValueError(f"{path}: text prompts need a model with a tokenizer")
            ids = tokenizer(r["prompt"])["input_ids"]
        n = int(r.get("output_len", output_len))
        if not ids or n < 1:
            raise ValueError(f"{path}: request {i} has an empty prompt or output_len < 1")
        out.append(({"prompt_token_ids": ids}, n))
    if not out:
        raise ValueError(f"{path}: no requests")
    return out


def run(args) -> int:
    from distengine import SamplingParams
    if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
    model = bc.resolve_model(args)
    dev = "cuda" if bc.has_cuda(args.device) else "cpu"
    from launch.bench.latency import _vocab
    vocab = _vocab(model)
    if args.dataset_path:
        from distengine.hf_config import load_tokenizer, resolve_model_path
        requests = load_dataset(args.dataset_path, load_tokenizer(str(resolve_model_path(model))),
                                args.output_len, args.num_prompts)
    else:
        requests = [(p, args.output_len) for p in bc.random_prompts(vocab, args.num_prompts, args.input_len, args.seed)]
    prompt_lens = [len(p["prompt_token_ids"]) for p, _ in requests]
    hf = None
    if args.hf:
        if args.dataset_path or len(set(prompt_lens)) > 1:
            raise ValueError("--hf runs random prompts of one length (no --dataset-path)")
        hf = bc.hf_generate(model, [p for p, _ in requests], args.output_len, dev)
    longest = max(len(p["prompt_token_ids"]) + n for p, n in requests)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    prompts = [p for p, _ in requests]
    warm = min(8, len(prompts))
    if args.async_engine:
        from distengine.async_llm import AsyncLLM
        runner = AsyncLLM(model, **bc.engine_options(args, longest))
        generate = _async_generate
    else:
        runner = bc.make_llm(args, model, longest)
        generate = _llm_generate
    try:
        rf = bc.roofline_of(runner)
        bandwidth, matmul = rf.bandwidth, rf.matmul
        generate(runner, prompts[:warm], params[:warm], "warm-up")
        t = time.perf_counter()
        n_out = generate(runner, prompts, params, "bench")
        elapsed = time.perf_counter() - t
        info = bc.engine_summary(runner.info)
    finally:
        runner.shutdown()
    n_in = sum(prompt_lens)
    roof = rf.prefill_s(n_in)
    wave = args.max_num_seqs
    for i in range(0, len(requests), wave):
        chunk = requests[i:i + wave]
        mean_in = sum(len(p["prompt_token_ids"]) for p, _ in chunk) // len(chunk)
        roof += rf.decode_s(len(chunk), mean_in, max(n for _, n in chunk))
    device = info["device_name"]
    ours, roof_tok = n_out / elapsed, n_out / roof
    print(f"\nThroughput: {len(requests) / elapsed:.2f} requests/s, {(n_in + n_out) / elapsed:.2f} total tokens/s, "
          f"{ours:.2f} output tokens/s")
    runner_name = "AsyncLLM" if args.async_engine else "LLM.generate"
    print(f"{device}, TP={args.tensor_parallel_size}, {runner_name}; model {model}; {len(requests)} requests, {n_in} prompt and "
          f"{n_out} output tokens; copy bandwidth {bandwidth / 1e12:.2f} TB/s, product rate {matmul / 1e12:.0f} "
          f"TFLOP/s (same run)")
    rows = [("figure", "ours", "roofline", "ours/roofline"),
            ("output tok/s", f"{ours:.1f}", f"{roof_tok:.1f}", f"{ours / roof_tok:.2f}")]
    if hf:
        rows.append(("HF generate output tok/s", f"{hf:.1f}", "", f"ours {ours / hf:.2f}x"))
    bc.print_table(rows)
    if bc.routing_note(rf):
        print(bc.routing_note(rf))
    bc.write_json(args.output_json, dict(kind="throughput", device=device, tp=args.tensor_parallel_size, model=model,
                                         async_engine=args.async_engine,
                                         num_requests=len(requests), prompt_tokens=n_in, output_tokens=n_out,
                                         elapsed_time=elapsed, requests_per_second=len(requests) / elapsed,
                                         tokens_per_second=(n_in + n_out) / elapsed, output_tok_s=ours,
                                         roofline_output_tok_s=roof_tok, hf_output_tok_s=hf,
                                         copy_bandwidth=bandwidth, matmul_rate=matmul, engine=info))
    return 0
