"""On a GPU: FP8 weights (kernels.fp8) against bf16 ones at decode sizes, Gemma-3-12B's
projections, timed inside CUDA graphs as `kernels.bench.decode_batch1` times them (REPS calls, each
on its own weights, so nothing stays in L2 between calls).

Per shape and row count: the bf16 GEMV / skinny GEMM (what `linear_op` runs), the FP8 one with
128 x 128 block scales and with per-row scales (the engine's tiles, then a few alternatives for
the block case), and the FP8 weight dequantized for cuBLAS (`dequantize_fp8` + F.linear, what the
layers run past 128 rows), each beside the copy-rate time of the weight's bytes as stored (2 or 1
an element; scales and x are under 0.1% of it) and the ratio. Past 32 rows bf16 is cuBLAS's.

    python -m kernels.bench.fp8_gemv [--rows 1 8 32 64 128]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from kernels.bench.graph_timing import REPS, graph_time_us
from kernels.bench.roofline import copy_bandwidth
from kernels.fp8 import dequantize_fp8, quantize_fp8_ref
from kernels.gemv import FP8_SKINNY_MAX_ROWS, SKINNY_MAX_ROWS, gemv, skinny_gemm

SHAPES = {"qkv": (8192, 3840), "o_proj": (3840, 4096), "gate_up": (30720, 3840), "down": (3840, 15360)}
BLOCK = (128, 128)
# Alternatives to the shipped tiles for the FP8 block case (one row: BLOCK_N, BLOCK_K, warps, stages,
# CHUNK): the whole-tile accumulator (CHUNK 1) and runs of 16 keys summed first, as `gemv_config`.
GEMV_CANDIDATES = [(16, 1024, 8, 1, 1), (4, 512, 4, 3, 1), (16, 1024, 8, 1, 16), (16, 2048, 4, 1, 16),
                   (16, 2048, 8, 1, 16), (16, 4096, 8, 1, 16), (8, 4096, 8, 1, 16)]


def _op(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, block, y: torch.Tensor, cfg=None,
        dequantize: bool = False):
    """What the layers run (`workers.ops.linear_op` / `fp8_linear_op`); `dequantize`: the FP8
    weight through `dequantize_fp8` and cuBLAS whatever the rows."""
    if dequantize or x.shape[0] > (SKINNY_MAX_ROWS if s is None else FP8_SKINNY_MAX_ROWS):
        wd = w if s is None else dequantize_fp8(w, s, block, x.dtype)
        return torch.mm(x, wd.t(), out=y)
    kernel = gemv if x.shape[0] == 1 else skinny_gemm
    return kernel(x, w, out=y, config=cfg, weight_scale=s, block_size=block)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    args = p.parse_args(argv)
    dt, dev = torch.bfloat16, "cuda"
    bw = copy_bandwidth(dev)
    print(f"copy {bw / 1e12:.2f} TB/s; {REPS} calls per graph")
    print(f"\n{'op':8} {'rows':>4} {'variant':30} {'us/call':>8} {'copy-rate':>9} {'x copy':>6}")
    for name, (n, k) in SHAPES.items():
        full = [torch.randn(n, k, device=dev) * 0.02 for _ in range(REPS)]
        bf16 = [w.to(dt) for w in full]
        fp8 = {"block": [quantize_fp8_ref(w, BLOCK) for w in full], "row": [quantize_fp8_ref(w) for w in full]}
        del full
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dt)
            ys = [torch.empty(m, n, device=dev, dtype=dt) for _ in range(REPS)]
            ref = F.linear(x.float(), bf16[0].float())
            cases = [("bf16", None, None, None, 2, False)]
            cases += [(f"fp8 {kind} scales", kind, BLOCK if kind == "block" else None, None, 1, False) for kind in fp8]
            cases += [("fp8 block: dequantize + cuBLAS", "block", BLOCK, None, 1, True)]
            if m == 1:
                cases += [(f"fp8 block {c}", "block", BLOCK, dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "CHUNK"),
                                                                     c)), 1, False) for c in GEMV_CANDIDATES]
            for label, kind, block, cfg, elem, deq in cases:
                ws = bf16 if kind is None else [q for q, _ in fp8[kind]]
                ss = [None] * REPS if kind is None else [s for _, s in fp8[kind]]
                y = _op(x, ws[0], ss[0], block, ys[0], cfg, deq)
                err = (y.float() - ref).abs().max().item()
                if err > 0.05 * ref.abs().max().item():  # FP8 rounding: a few percent of the largest output
                    print(f"{name:8} {m:4} {label:30} wrong ({err:.3g})")
                    continue
                t = graph_time_us([lambda w=w, s=s, y=y: _op(x, w, s, block, y, cfg, deq)
                                   for w, s, y in zip(ws, ss, ys)])
                ideal = n * k * elem / bw * 1e6
                print(f"{name:8} {m:4} {label:30} {t:8.2f} {ideal:9.2f} {t / ideal:6.2f}")
        del bf16, fp8
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
