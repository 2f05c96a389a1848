"""On a Hopper GPU: does programmatic dependent launch (PDL) shorten a batch-1 decode layer?

A Gemma-3-12B-shaped batch-1 layer as the engine runs it in a CUDA graph: 4 GEMVs (qkv, o_proj,
gate_up, down) and 8 one-program row kernels between them (the norms, q/k norm + rotary, the KV
store, attention's merge, the activation: stand-ins of one RMSNorm each, ~2 us). 24 layers on
their own weights (nothing stays in L2), captured once per variant, replayed, timed with CUDA
events. Variants: plain launches; PDL on every kernel (each waits for its predecessor at its top,
then lets its successor launch); PDL with the GEMVs also loading their first weight tile before
the wait (weights are never written by a predecessor).

    python -m kernels.bench.pdl_layer
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.bench.graph_timing import graph_time_us
from kernels.bench.roofline import copy_bandwidth
from kernels.pdl import pdl_wait

LAYERS = 24
HIDDEN, QKV, INTER = 3840, 8192, 15360


@triton.jit
def _norm(x_ptr, w_ptr, y_ptr, n, PDL: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: safe before the wait
    pdl_wait(PDL)
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / n + 1e-6)
    tl.store(y_ptr + cols, (x * r * (w + 1.0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv(x_ptr, w_ptr, y_ptr, N, K, stride_wn, PDL: tl.constexpr, PREFETCH: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    start = 0
    if PREFETCH:  # the first weight tile does not depend on the kernel before
        w0 = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
        start = BLOCK_K
    pdl_wait(PDL)
    if PREFETCH:
        x0 = tl.load(x_ptr + rk, mask=rk < K, other=0.0)
        acc += w0.to(tl.float32) * x0.to(tl.float32)[None, :]
    for k in range(start, K, BLOCK_K):
        kk = k + rk
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + rn, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(n: int) -> tuple[int, int, int, int]:  # kernels.gemv.gemv_config's whole-tile tiles (its fp32 rule)
    if n <= 4096:
        return 16, 1024, 8, 1
    if n <= 16384:
        return 4, 256, 4, 3
    return 8, 256, 4, 1


def main() -> int:
    dt, dev = torch.bfloat16, "cuda"
    bw = copy_bandwidth("cuda")
    shapes = [(QKV, HIDDEN), (HIDDEN, 4096), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [[torch.randn(n, k, dtype=dt, device=dev) * 0.02 for n, k in shapes] for _ in range(LAYERS)]
    nw = torch.randn(2 * INTER, dtype=dt, device=dev) * 0.1
    h = torch.randn(1, 2 * INTER, dtype=dt, device=dev)
    bufs = [torch.zeros(1, 2 * INTER, dtype=dt, device=dev) for _ in range(4)]
    weight_bytes = sum(n * k for n, k in shapes) * 2

    def layer_calls(ws, pdl: bool, prefetch: bool):
        kw = {"launch_pdl": True} if pdl else {}

        def norm(src, dst, n):
            _norm[(1,)](src, nw, dst, n, PDL=pdl, BLOCK=triton.next_power_of_2(n), num_warps=8, **kw)

        def mv(src, w, dst):
            bn, bk, warps, stages = gemv_config(w.shape[0])
            _gemv[(triton.cdiv(w.shape[0], bn),)](src, w, dst, w.shape[0], w.shape[1], w.stride(0), PDL=pdl,
                                                 PREFETCH=prefetch, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                                 num_stages=stages, **kw)
        a, b, c, d = bufs
        return [lambda: norm(h, a, HIDDEN), lambda: mv(a, ws[0], b), lambda: norm(b, c, 4096),
                lambda: norm(c, d, 4096), lambda: norm(d, a, 4096), lambda: mv(a, ws[1], b),
                lambda: norm(b, c, HIDDEN), lambda: norm(c, d, HIDDEN), lambda: mv(d, ws[2], a),
                lambda: norm(a, b, INTER), lambda: mv(b, ws[3], c), lambda: norm(c, h, HIDDEN)]

    def timed(pdl: bool, prefetch: bool) -> float:
        calls = [f for ws in weights for f in layer_calls(ws, pdl, prefetch)]
        return graph_time_us(calls) * len(calls) / LAYERS

    def result(pdl: bool, prefetch: bool) -> torch.Tensor:
        h.copy_(torch.linspace(-1, 1, 2 * INTER, device=dev).to(dt)[None])
        for ws in weights[:2]:
            for f in layer_calls(ws, pdl, prefetch):
                f()
        torch.cuda.synchronize()
        return h.clone()

    ref = result(False, False)
    rows = []
    for name, pdl, prefetch in (("plain", False, False), ("PDL", True, False), ("PDL + prefetch", True, True),
                                ("plain (again)", False, False)):
        same = torch.equal(result(pdl, prefetch), ref)
        rows.append((name, timed(pdl, prefetch), same))
    print(f"copy {bw / 1e12:.2f} TB/s; a layer's weights {weight_bytes / 1e6:.1f} MB: {weight_bytes / bw * 1e6:.1f} us "
          f"at the copy rate")
    print("variant          us/layer  same result")
    for name, us, same in rows:
        print(f"{name:16s} {us:8.1f}  {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
