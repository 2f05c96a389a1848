"""y = x W^T (+ b) for a single row x: a batch-1 decode step's projections.

Why a Triton kernel: at one row a projection only streams its weight, and cuBLAS picks tiles
made for wider products (64 or more output columns per tile, split-K with a second reduce
kernel for the narrow matrices). Timed inside CUDA graphs on one H200, 24 calls each on its own
weights (`tests/gpu/micro_b1.py`), Gemma-3-12B's shapes: o_proj 10.1 us against F.linear's 13.4,
down_proj 29.2 against 34.2, gate_up 54.8 against 58.0, qkv 17.2 against 17.7: the weight read
at 3.1 / 4.0 / 4.3 / 3.7 TB/s (copy 4.24 TB/s); a batch-1 decode step of the whole model 7.15 ms
against 7.95. The layers call it for one row (`workers.ops.linear_op`); more rows, and the LM
head (0.45 ms in cuBLAS, at the copy rate already), go to F.linear.

One program owns BLOCK_N output columns and walks K in BLOCK_K steps, accumulating x * W in
fp32 registers and reducing across K once at the end, so every weight element is read once and
the partial sums never leave the program. The weight's rows must be contiguous (any row stride).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["gemv", "gemv_ref", "gemv_config"]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        k_ok = kk < K
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv_config(n: int, k: int) -> dict:
    """Tiles from the H200 sweep above: few output columns over a long K (o_proj, down_proj: N
    3840) want wide programs, 16 columns x 1024 keys on 8 warps; many columns (qkv, gate_up)
    narrow ones, 4-8 columns x 256 on 4 warps, so that ~2,000-4,000 programs spread the read."""
    if n <= 4096:
        return {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 8, "num_stages": 1}
    if n <= 16384:
        return {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1}


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row x [1, K], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, {x.shape[1]}], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if x.dtype != weight.dtype or (bias is not None and bias.dtype != x.dtype):
        raise TypeError(f"x, weight and bias need one dtype, got {x.dtype}, {weight.dtype}, "
                        f"{None if bias is None else bias.dtype}")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x[1, K] @ weight[N, K]^T (+ bias[N]) -> `out` or a new [1, N] tensor, x's dtype (fp32 sums)."""
    _check(x, weight, bias)
    n, k = weight.shape
    if out is None:
        out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (1, n) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [1, {n}] {x.dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    if n == 0:
        return out
    if k == 0:
        return out.copy_(bias[None] if bias is not None else torch.zeros_like(out))
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    cfg = config or gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else x, out, n, k, weight.stride(0), HAS_BIAS=bias is not None,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in fp32 (fp64 for fp64 inputs), rounded once to x's dtype."""
    _check(x, weight, bias)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = F.linear(x.to(acc), weight.to(acc), None if bias is None else bias.to(acc))
    return y.to(x.dtype)
