"""On a GPU: the decode step's time without the profiler against the HBM roofline of the same run
(the weights and cache bytes as stored over the copy bandwidth measured on the engine's device),
then device-busy time (torch.profiler) and the kernels that take it.

    python -m launch.bench.profile_decode MODEL_DIR [--batch 1 128] [--load-format dummy] [--quantization fp8]
        [--tp 1] [--eager] [--top 10] [--marginal] [--rounds 3 --steps 50] [--profile-steps 20 | --no-profile]

`--rounds` times that many rounds of `--steps` decode steps each (the spread between rounds is
what a change must beat); the roofline counts the contexts at the middle of each round. CUDA
graphs are captured for the batches timed only.

With programmatic dependent launch (kernels/pdl.py, on Hopper) a kernel starts before the one
before it ends and its time includes that wait, so the kernels' times add up to more than the
step: run with DISTENGINE_PDL=0 for each kernel's own time, or `--marginal` for what each kind
of kernel adds to the step as it runs, PDL on: the time from the end of the kernel before to its
own end (`marginal_costs`; the sum is the profiled span), by kernel and grid.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from distengine import LLM, SamplingParams
from distengine.quantization import QUANTIZATION_CHOICES
from distengine.scheduler import EngineRequest
from launch.bench.common import random_prompts, roofline_of

WARMUP_STEPS = 5


def device_us(e) -> float:
    return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)


def kernel_averages(prof) -> list:
    """The profile's device events (kernels, copies, memsets) by name, each with device time: the
    host's operators and runtime calls (aten::mm, cudaGraphLaunch, "Command Buffer Full") report
    the time of the kernels they launch as their own device time too, so summing every event
    counted those kernels twice."""
    return [e for e in prof.key_averages() if e.device_type != DeviceType.CPU and device_us(e) > 0]


@dataclass
class KernelCost:
    """One kind of kernel (name and grid) in the profiled steps, per step."""
    name: str
    grid: tuple[int, ...]
    launches: float
    marginal_us: float  # what it adds to the span: from the previous kernel's end to its own
    busy_us: float      # its kernels' own durations (with PDL, including their waits)


def marginal_costs(kernels: list[dict], steps: int) -> list[KernelCost]:
    """`kernels`: a chrome trace's kernel events (name, ts, dur in us, args.grid) of `steps`
    steps, largest marginal cost first. A kernel that ends before one started earlier adds
    nothing; after an idle gap it adds the gap and its duration."""
    costs: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    end = None
    for e in sorted(kernels, key=lambda e: e["ts"]):
        stop = e["ts"] + e["dur"]
        added = e["dur"] if end is None else max(0.0, stop - end)
        end = stop if end is None else max(end, stop)
        c = costs.setdefault((e["name"], tuple(e.get("args", {}).get("grid", ()))), [0, 0.0, 0.0])
        c[0] += 1
        c[1] += added
        c[2] += e["dur"]
    out = [KernelCost(name, grid, n / steps, m / steps, b / steps) for (name, grid), (n, m, b) in costs.items()]
    return sorted(out, key=lambda c: -c.marginal_us)


def _kernel_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 128])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help="as `bench latency --quantization`")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--top", type=int, default=10, help="kernels listed per batch")
    p.add_argument("--marginal", action="store_true", help="each kind of kernel's share of the step's span")
    p.add_argument("--rounds", type=int, default=1, help="rounds of --steps timed decode steps (default: %(default)s)")
    p.add_argument("--steps", type=int, default=40, help="decode steps a round (default: %(default)s)")
    p.add_argument("--profile-steps", type=int, default=20, help="steps under the profiler (default: %(default)s)")
    p.add_argument("--no-profile", action="store_true", help="only the timed rounds and the roofline")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="the engine's bound, which CUDA graphs' attention splits follow (default: %(default)s)")
    args = p.parse_args(argv)
    if min(args.rounds, args.steps, args.profile_steps, *args.batch) < 1:
        p.error("--rounds, --steps, --profile-steps and --batch take positive integers")
    # Every sequence decodes through the first tokens, the warm-up, the rounds and the profiled
    # steps (and a few more: none ends inside them).
    max_tokens = 2 + WARMUP_STEPS + args.rounds * args.steps + (0 if args.no_profile else args.profile_steps) + 4
    if args.input_len + max_tokens > args.max_model_len:
        p.error(f"--input-len {args.input_len} and {max_tokens} decode steps exceed --max-model-len "
                f"{args.max_model_len}")
    with LLM(args.model, tensor_parallel_size=args.tp, load_format=args.load_format,
             max_model_len=args.max_model_len, enforce_eager=args.eager, quantization=args.quantization,
             cuda_graph_sizes=tuple(sorted(set(args.batch))), max_num_seqs=max(args.batch)) as llm:
        roofline = roofline_of(llm)
        print(f"copy {roofline.bandwidth / 1e12:.2f} TB/s (same run)")
        vocab = llm.info.vocab_size
        core = llm.engine
        for b in args.batch:
            reqs = [EngineRequest(f"{b}-{i}", p["prompt_token_ids"],
                                  sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
                    for i, p in enumerate(random_prompts(vocab, b, args.input_len, b))]
            for r in reqs:
                core.add_request(r)
            while any(r.num_output_tokens < 2 for r in reqs):
                core.step()
            for _ in range(WARMUP_STEPS):
                core.step()
            rounds = [_timed_round(core, reqs, args.input_len, args.steps, roofline) for _ in range(args.rounds)]
            steps = [s for s, _ in rounds]
            ratios = [s / roof for s, roof in rounds]
            roofs = [roof for _, roof in rounds]
            print(f"\nB={b} TP={args.tp}: decode step {_span(steps, 1e3)} ms ({args.rounds} x {args.steps} steps, no "
                  f"profiler) against a roofline of {_span(roofs, 1e3)} ms: {_span(ratios, 1, 3)}x")
            if not args.no_profile:
                _profile(core, args)
            core.abort([r.request_id for r in reqs])
            while core.scheduler.has_in_flight() or core.has_unfinished():
                core.step()
            core.step()
    return 0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _span(xs: list[float], scale: float, digits: int = 3) -> str:
    lo, hi = min(xs) * scale, max(xs) * scale
    return f"{lo:.{digits}f}" if f"{lo:.{digits}f}" == f"{hi:.{digits}f}" else f"{lo:.{digits}f}-{hi:.{digits}f}"


def _timed_round(core, reqs, input_len: int, steps: int, roofline) -> tuple[float, float]:
    """(seconds a decode step, the roofline's seconds at the round's middle context)."""
    start = input_len + reqs[0].num_output_tokens
    _sync()
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    _sync()
    took = (time.perf_counter() - t) / steps
    mid = (start + input_len + reqs[0].num_output_tokens) // 2
    return took, roofline.decode_step_s([mid] * len(reqs))


def _profile(core, args) -> None:
    """--profile-steps steps under torch.profiler: the kernels' time a step, the largest kernels,
    and with --marginal each kind's share of the span."""
    n = args.profile_steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(n):
            core.step()
        _sync()
    events = kernel_averages(prof)
    busy = sum(device_us(e) for e in events) / n / 1e3
    launches = sum(e.count for e in events) / n
    print(f"  profiled: kernel time {busy:.2f} ms a step in ~{launches:.0f} kernels (with PDL it includes their "
          f"waits)")
    for e in sorted(events, key=device_us, reverse=True)[:args.top]:
        print(f"  {device_us(e) / n / 1e3:7.3f} ms  x{e.count / n:5.0f}  {e.key[:90]}")
    if args.marginal:
        costs = marginal_costs(_kernel_events(prof), n)
        print(f"  share of the span, per step: {sum(c.marginal_us for c in costs) / 1e3:.3f} ms")
        for c in costs[:args.top]:
            print(f"  {c.marginal_us / 1e3:7.3f} ms  x{c.launches:5.0f}  grid {str(c.grid):14} "
                  f"(own {c.busy_us / 1e3:.3f} ms)  {c.name[:60]}")


if __name__ == "__main__":
    raise SystemExit(main())
