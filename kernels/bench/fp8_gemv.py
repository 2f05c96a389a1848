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
import itertools

import torch
import torch.nn.functional as F

from kernels.bench.graph_timing import REPS, graph_time_us
from kernels.bench.roofline import copy_bandwidth
from kernels.fp8 import dequantize_fp8, quantize_fp8_ref
from kernels.fp8_gemm import W8A8_MAX_ROWS, w8a8_config, w8a8_gemm, w8a8_gemm_ref
from kernels.gemv import FP8_SKINNY_MAX_ROWS, SKINNY_MAX_ROWS, gemv, skinny_gemm

SHAPES = {"qkv": (8192, 3840), "o_proj": (3840, 4096), "gate_up": (30720, 3840), "down": (3840, 15360)}
BLOCK = (128, 128)
# Alternatives to the shipped tiles for the FP8 block case (one row: BLOCK_N, BLOCK_K, warps, stages).
GEMV_CANDIDATES = [(4, 512, 4, 3), (8, 512, 4, 2), (16, 1024, 8, 1), (16, 2048, 8, 1), (32, 1024, 8, 1)]
W8A8_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SWAP", "num_warps", "num_stages")
# The W8A8 sweep per row tile: columns x keys x operand order x (warps, stages).
W8A8_GRID = list(itertools.product((32, 64, 128), (128, 256), (True, False), ((4, 3), (4, 5), (8, 3))))


def _w8a8_row_tiles(rows: int) -> list[int]:
    """The engine's row tile for `rows`, the next smaller one (more row tiles, each quantizing
    fewer rows of x) and past 64 rows a 128-row one."""
    own = w8a8_config(1, 1, rows)["BLOCK_M"]
    return [own] + ([own // 2] if own > 16 else []) + ([128] if rows > 64 else [])


def _op(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, block, y: torch.Tensor, cfg=None,
        dequantize: bool = False):
    """What the layers run (`workers.ops.linear_op` / `fp8_linear_op`); `dequantize`: the FP8
    weight through `dequantize_fp8` and cuBLAS whatever the rows."""
    if dequantize or x.shape[0] > (SKINNY_MAX_ROWS if s is None else FP8_SKINNY_MAX_ROWS):
        wd = w if s is None else dequantize_fp8(w, s, block, x.dtype)
        return torch.mm(x, wd.t(), out=y)
    kernel = gemv if x.shape[0] == 1 else skinny_gemm
    return kernel(x, w, out=y, config=cfg, weight_scale=s, block_size=block)


def _w8a8_ok(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block) -> bool:
    ref = w8a8_gemm_ref(x, w, s, block)
    return (y.double() - ref).abs().max().item() <= 0.01 * ref.abs().max().item()  # bf16 rounding


def sweep(args, bw: float) -> None:
    dt, dev = torch.bfloat16, "cuda"
    print(f"\nW8A8 tiles, {BLOCK} block scales; us a call (x the copy rate of the FP8 bytes); "
          f"tiles as {W8A8_KEYS}", flush=True)
    for name in args.shapes:
        n, k = SHAPES[name]
        fp8 = [quantize_fp8_ref(torch.randn(n, k, device=dev) * 0.02, BLOCK) for _ in range(REPS)]
        ideal = n * k / bw * 1e6
        for m in args.rows:
            if m > W8A8_MAX_ROWS:
                continue
            x = torch.randn(m, k, device=dev, dtype=dt)
            ys = [torch.empty(m, n, device=dev, dtype=dt) for _ in range(REPS)]
            rule = w8a8_config(n, k, m)
            cfgs = [rule] + [dict(zip(W8A8_KEYS, (bm, bn, bk, swap, warps, stages)))
                             for bm in _w8a8_row_tiles(m) for bn, bk, swap, (warps, stages) in W8A8_GRID]
            res, t_rule = [], None
            for cfg in cfgs:
                try:
                    y = w8a8_gemm(x, fp8[0][0], fp8[0][1], BLOCK, out=ys[0], config=cfg)
                except Exception as e:  # out of shared memory, or a layout the compiler refuses
                    print(f"  {name} rows {m} {tuple(cfg[key] for key in W8A8_KEYS)}: {type(e).__name__}", flush=True)
                    continue
                if not _w8a8_ok(y, x, fp8[0][0], fp8[0][1], BLOCK):
                    print(f"  {name} rows {m} {tuple(cfg[key] for key in W8A8_KEYS)}: wrong", flush=True)
                    continue
                t = graph_time_us([lambda w=w, s=s, y=y, cfg=cfg: w8a8_gemm(x, w, s, BLOCK, out=y, config=cfg)
                                   for (w, s), y in zip(fp8, ys)])
                if t_rule is None and cfg is rule:
                    t_rule = t
                res.append((t, tuple(cfg[key] for key in W8A8_KEYS)))
            res.sort()
            rule_text = "failed" if t_rule is None else f"{t_rule:6.2f} ({t_rule / ideal:4.2f})"
            print(f"{name:8} rows {m:<3} copy-rate {ideal:6.2f}  rule {rule_text}  best "
                  + "  ".join(f"{t:6.2f} ({t / ideal:4.2f}) {c}" for t, c in res[:5]), flush=True)
        del fp8
        torch.cuda.empty_cache()


def _w8a8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, block, y: torch.Tensor, cfg=None, _=None):
    """What an FP8 layer runs with W8A8 (`workers.ops.fp8_linear_op`, w8a8) up to 128 rows."""
    return w8a8_gemm(x, w, s, block, out=y, config=cfg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    p.add_argument("--sweep", action="store_true", help="W8A8 tiles per (projection, rows), best first")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = p.parse_args(argv)
    dt, dev = torch.bfloat16, "cuda"
    bw = copy_bandwidth(dev)
    print(f"copy {bw / 1e12:.2f} TB/s; {REPS} calls per graph")
    if args.sweep:
        sweep(args, bw)
        return 0
    print(f"\n{'op':8} {'rows':>4} {'variant':30} {'us/call':>8} {'copy-rate':>9} {'x copy':>6}")
    for name in args.shapes:
        n, k = SHAPES[name]
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
            if m <= W8A8_MAX_ROWS:
                cases += [(f"w8a8 {kind} scales", kind, BLOCK if kind == "block" else None, None, 1, "w8a8")
                          for kind in fp8]
            if m == 1:
                cases += [(f"fp8 block {c}", "block", BLOCK, dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
                                                                     c)), 1, False) for c in GEMV_CANDIDATES]
            for label, kind, block, cfg, elem, deq in cases:
                ws = bf16 if kind is None else [q for q, _ in fp8[kind]]
                ss = [None] * REPS if kind is None else [s for _, s in fp8[kind]]
                op = _w8a8 if deq == "w8a8" else _op
                y = op(x, ws[0], ss[0], block, ys[0], cfg, deq)
                if deq == "w8a8":
                    if not _w8a8_ok(y, x, ws[0], ss[0], block):
                        print(f"{name:8} {m:4} {label:30} wrong")
                        continue
                else:
                    err = (y.float() - ref).abs().max().item()
                    if err > 0.05 * ref.abs().max().item():  # FP8 rounding: a few percent of the largest output
                        print(f"{name:8} {m:4} {label:30} wrong ({err:.3g})")
                        continue
                t = graph_time_us([lambda w=w, s=s, y=y: op(x, w, s, block, y, cfg, deq)
                                   for w, s, y in zip(ws, ss, ys)])
                ideal = n * k * elem / bw * 1e6
                print(f"{name:8} {m:4} {label:30} {t:8.2f} {ideal:9.2f} {t / ideal:6.2f}")
        del bf16, fp8
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
