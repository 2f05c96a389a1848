"""On a GPU: tile sweep of `kernels.gemv.skinny_gemm` against cuBLAS at Gemma-3-12B's projection
shapes (and their TP=2 shards), each configuration timed inside a CUDA graph of calls on their
own weights (as `decode_batch1.py`). `skinny_config`'s rule is the best of this sweep per shape (one
H200). Rows past SKINNY_MAX_ROWS launch the kernel itself with a 64- or 128-row tile, to see
whether it could beat cuBLAS there too (it did not enough: the README).

    python -m kernels.bench.sweep_skinny_gemm [ROWS ...]     # default 8 16 32; e.g. 64 128
"""
from __future__ import annotations

import itertools
import sys

import torch
import triton

from kernels.bench.graph_timing import REPS, graph_time_us
from kernels.bench.roofline import copy_bandwidth
from kernels.gemv import SKINNY_MAX_ROWS, _skinny_kernel, skinny_gemm
from kernels.paged_attention import _interpreter_bf16

SHAPES = {"qkv": (8192, 3840), "o_proj": (3840, 4096), "gate_up": (30720, 3840), "down": (3840, 15360),
          "qkv/2": (4096, 3840), "o_proj/2": (3840, 2048), "gate_up/2": (15360, 3840), "down/2": (3840, 7680)}
# (BLOCK_N, BLOCK_K, num_warps, num_stages, SWAP)
CONFIGS = ([(bn, bk, w, st, True) for bn, bk, w, st in itertools.product((16, 32), (256, 512, 1024), (4, 8), (3, 4, 6))]
           + [(64, 256, 4, st, sw) for st, sw in itertools.product((2, 3, 4, 5), (False, True))])
# Tiles for 64 and 128 rows: wider columns, shallower keys.
WIDE = [(bn, bk, w, st, sw) for bn, bk, w, st, sw in
        itertools.product((32, 64), (128, 256), (4, 8), (3, 4), (False, True))]


def wide_rows(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, cfg: dict) -> torch.Tensor:
    """`skinny_gemm`'s kernel over more rows (a 64- or 128-row tile), no bias."""
    m, k = x.shape
    n = w.shape[0]
    _skinny_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, w, x, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), HAS_BIAS=False,
        EVEN=(n % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0), SWAP=cfg["SWAP"],
        DOT_F32=_interpreter_bf16(x), PRECISION="tf32", BLOCK_M=64 if m <= 64 else 128, BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def main() -> int:
    dt, dev = torch.bfloat16, "cuda"
    bw = copy_bandwidth("cuda")
    print(f"copy {bw / 1e12:.2f} TB/s", flush=True)
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(REPS)]
        ideal = N * K * 2 / bw * 1e6
        for m in [int(a) for a in sys.argv[1:]] or [8, 16, 32]:
            x = torch.randn(m, K, device=dev, dtype=dt)
            ys = [torch.empty(m, N, device=dev, dtype=dt) for _ in range(REPS)]
            ref = torch.nn.functional.linear(x.float(), ws[0].float())
            t_cublas = graph_time_us([lambda w=w, y=y: torch.nn.functional.linear(x, w, out=y) for w, y in zip(ws, ys)])
            res = []
            wide = m > SKINNY_MAX_ROWS
            op = wide_rows if wide else (lambda x, w, y, cfg: skinny_gemm(x, w, out=y, config=cfg))
            for bn, bk, warps, stages, swap in WIDE if wide else CONFIGS:
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "SWAP": swap}
                try:
                    y = op(x, ws[0], ys[0], cfg)
                except Exception as e:  # a configuration out of shared memory
                    print(f"  {name} rows {m} {cfg}: {type(e).__name__}", flush=True)
                    continue
                if (y.float() - ref).abs().max().item() > 0.02 * ref.abs().max().item():
                    print(f"  {name} rows {m} {cfg}: wrong", flush=True)
                    continue
                t = graph_time_us([lambda w=w, y=y, cfg=cfg: op(x, w, y, cfg) for w, y in zip(ws, ys)])
                res.append((t, (bn, bk, warps, stages, swap)))
            res.sort()
            print(f"{name:8} rows {m:<3} ideal {ideal:6.1f}  cuBLAS {t_cublas:6.1f}  best "
                  + "  ".join(f"{t:6.1f} {c}" for t, c in res[:3]), flush=True)
        del ws
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
