"""Engine throughput against Hugging Face `generate` on the same random-weight model, same run.

    python -m launch.bench_engine --tp 1 2 [--batch 32] [--input-len 512] [--output-len 128]

A Gemma-3-shaped text model (the 4B shape by default: 34 layers, 5 sliding : 1 full, head 256) is
built with random bf16 weights and saved once; HF generate (greedy, fixed output length) is timed
first, then our engine at each TP size. Prints output tokens per second and the ratio.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch

SHAPES = {
    "gemma-3-4b": dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, sliding_window=1024, vocab_size=262208),
    "gemma-3-12b": dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=256, sliding_window=1024, vocab_size=262208),
}


def build(folder: str, shape: str) -> None:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    if os.path.exists(os.path.join(folder, "config.json")):
        return
    cfg = Gemma3TextConfig(**SHAPES[shape], max_position_embeddings=8192, sliding_window_pattern=6)
    with torch.device("cuda"):
        model = Gemma3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model


def hf_generate(folder: str, ids: torch.Tensor, out_len: int) -> float:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda").eval()
    ids = ids.cuda()
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out_len,
                             min_new_tokens=out_len, do_sample=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    n = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return n / dt


def ours(folder: str, ids: torch.Tensor, out_len: int, tp: int) -> tuple[float, dict]:
    from distengine import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    prompts = [{"prompt_token_ids": row} for row in ids.tolist()]
    t0 = time.perf_counter()
    with LLM(folder, tensor_parallel_size=tp, dtype="bfloat16", max_model_len=2048,
             gpu_memory_utilization=0.85) as llm:
        start = time.perf_counter() - t0
        llm.generate([{"prompt_token_ids": ids[0, :16].tolist()}], SamplingParams(max_tokens=4), use_tqdm=False)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        info = {"start_s": start, "num_blocks": llm.scheduler.manager.pool.num_blocks,
                "groups": len(llm.plan.groups), "block_size": llm.plan.block_size}
    return n / dt, info


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, nargs="+", default=[1])
    p.add_argument("--shape", default="gemma-3-4b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--folder", default="/tmp/distengine-bench-model")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    torch.manual_seed(0)
    build(args.folder, args.shape)
    ids = torch.randint(10, 200000, (args.batch, args.input_len))
    rows = [{"what": f"HF generate ({args.shape}, 1 GPU)", "tok_s": hf_generate(args.folder, ids, args.output_len)}]
    print(json.dumps(rows[-1]), flush=True)
    for tp in args.tp:
        tok_s, info = ours(args.folder, ids, args.output_len, tp)
        rows.append({"what": f"distengine TP={tp}", "tok_s": tok_s, **info})
        print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "bench_engine.json"), "w") as f:
        json.dump(rows, f, indent=1)
    hf = rows[0]["tok_s"]
    print(f"\n{torch.cuda.get_device_name(0)}; {args.shape} random bf16 weights; batch {args.batch}, "
          f"in {args.input_len}, out {args.output_len}, greedy")
    for r in rows:
        print(f"{r['what']:36s} {r['tok_s']:9.1f} out tok/s  {r['tok_s'] / hf:5.2f}x HF")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
