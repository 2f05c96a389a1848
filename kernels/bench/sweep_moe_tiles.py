"""On a GPU: `fused_experts` in CUDA graphs at decode batch sizes under a grid of tile shapes, at
the shapes of kernels/bench/moe.py; prints each point's best tiles against the shipped rule
(`moe_config`). `--prefill`: prefill steps (1,024 to 8,192 tokens) under a grid of larger tiles,
with each point's time against the FLOP roofline (the bf16 product rate measured in the same run).

    python -m kernels.bench.sweep_moe_tiles [--prefill]
"""
from __future__ import annotations

import itertools
import sys

import torch

from kernels.activation import silu_and_mul
from kernels.bench.moe import SHAPES, expert_weights, graph_us
from kernels.bench.roofline import matmul_rate
from kernels.fused_moe import fused_experts, moe_config

GRID = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
        for m, n, k, w, s in itertools.product((16, 32, 64), (32, 64, 128), (64, 128, 256), (4,), (3, 4))
        if (m + n) * k * 2 * s <= 200 << 10]
PREFILL_GRID = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                for m, n, k, w, s in itertools.product((64, 128), (64, 128, 256), (32, 64, 128), (4, 8), (3, 4))
                if (m + n) * k * 2 * s <= 200 << 10]


# (BLOCK_M, BLOCK_N, BLOCK_K, stages) printed at every point, to choose a rule from
CANDIDATES = [(16, 64, 128, 4), (16, 128, 128, 4), (32, 64, 128, 3), (32, 128, 128, 3), (32, 128, 64, 4)]


def sweep_shape(name: str, shape: tuple[int, int, int, int], grid: list[dict], tokens: tuple[int, ...],
                prefill: bool, rate: float, g: torch.Generator) -> None:
    """Every tile of `grid` at each token count, for one shape. A function of its own so that the
    shape's experts (and the timed closures over them) are freed when it returns."""
    e, k, h, inter = shape
    w13, w2 = expert_weights(e, h, inter, g)
    for t in tokens:
        roof_us = 6 * t * k * h * inter / rate * 1e6
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        top, ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=1)
        weights = torch.softmax(top, dim=1).to(torch.bfloat16)
        shipped = graph_us(lambda: fused_experts(x, w13, w2, weights, ids, silu_and_mul))
        times = []
        for cfg in grid:
            try:
                times.append((graph_us(lambda: fused_experts(x, w13, w2, weights, ids, silu_and_mul, config=cfg)),
                              cfg))
            except Exception as exc:  # noqa: BLE001 - a tile that does not fit is skipped
                print(f"  skipped {cfg}: {type(exc).__name__}")
        best, cfg = min(times, key=lambda p: p[0])
        print(f"{name:20} {t:6} {shipped:8.1f} {best:8.1f} {best / roof_us:6.2f}  {cfg}  "
              f"(rule: {moe_config(t * k, e)}, {shipped / roof_us:.2f}x roof)", flush=True)
        by_tiles = {tuple(c.values()): us for us, c in times}
        if prefill:  # the five best, to choose a rule that holds across shapes
            for us, c in sorted(times, key=lambda p: p[0])[:5]:
                print(f"    {us:8.1f}  {tuple(c.values())}", flush=True)
            continue
        print("    " + "  ".join(f"{m}x{n}x{kk}/{st}: {by_tiles.get((m, n, kk, 4, st), float('nan')):.1f}"
                                 for m, n, kk, st in CANDIDATES), flush=True)


def main() -> int:
    prefill = "--prefill" in sys.argv[1:]
    grid, tokens = (PREFILL_GRID, (1024, 4096, 8192)) if prefill else (GRID, (1, 8, 32, 64, 128, 256))
    rate = matmul_rate("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"bf16 products {rate / 1e12:.0f} TFLOP/s (same run); x roof: time over the FLOP roofline")
    print(f"{'shape':20} {'tokens':>6} {'shipped':>8} {'best':>8} {'x roof':>6}  best tiles")
    for name, shape in SHAPES.items():
        sweep_shape(name, shape, grid, tokens, prefill, rate, g)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
