"""On a GPU: wall time against device-busy time of decode steps (torch.profiler), the kernels that
take the time, and the step time without the profiler.

    python -m launch.bench.profile_decode MODEL_DIR [--batch 1 128] [--load-format dummy] [--quantization fp8]
        [--tp 1] [--eager] [--top 10]

With programmatic dependent launch (kernels/pdl.py, on Hopper) a kernel starts before the one
before it ends and its time includes that wait, so the kernels' times add up to more than the
step: run with DISTENGINE_PDL=0 for each kernel's own time.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from distengine import LLM, SamplingParams
from distengine.scheduler import EngineRequest
from launch.bench.common import random_prompts


def device_us(e) -> float:
    return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 128])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="as `bench latency --quantization`")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--top", type=int, default=10, help="kernels listed per batch")
    args = p.parse_args()
    with LLM(args.model, tensor_parallel_size=args.tp, load_format=args.load_format, max_model_len=1024,
             enforce_eager=args.eager, quantization=args.quantization) as llm:
        vocab = llm.info.vocab_size
        core = llm.engine
        for b in args.batch:
            reqs = [EngineRequest(f"{b}-{i}", p["prompt_token_ids"],
                                  sampling=SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
                    for i, p in enumerate(random_prompts(vocab, b, args.input_len, b))]
            for r in reqs:
                core.add_request(r)
            while any(r.num_output_tokens < 2 for r in reqs):
                core.step()
            for _ in range(5):
                core.step()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(40):
                core.step()
            torch.cuda.synchronize()
            plain = (time.perf_counter() - t) / 40
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    core.step()
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if device_us(e) > 0]
            busy = sum(device_us(e) for e in events) / 20 / 1e3
            launches = sum(e.count for e in events) / 20
            print(f"\nB={b} TP={args.tp}: decode step {plain * 1e3:.2f} ms (no profiler); kernel time {busy:.2f} ms "
                  f"per step in ~{launches:.0f} kernels (with PDL it includes their waits)")
            for e in sorted(events, key=device_us, reverse=True)[:args.top]:
                print(f"  {device_us(e) / 20 / 1e3:7.3f} ms  x{e.count / 20:5.0f}  {e.key[:90]}")
            core.abort([r.request_id for r in reqs])
            while core.scheduler.has_in_flight() or core.has_unfinished():
                core.step()
            core.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
