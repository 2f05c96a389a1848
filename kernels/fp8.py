"""FP8 (float8_e4m3fn) weights with fp32 scales: W = weight * scale, the scale one per output row
([N]) or one per bn x bk block ([ceil(N/bn), ceil(K/bk)], the published block-wise layout; the
last block of a dimension may be partial).

Decode-sized products read the FP8 weight and dequantize in registers (`kernels.gemv`'s `gemv`
and `skinny_gemm` with `weight_scale`): the weight streams at one byte an element. Larger ones
(prefill) dequantize to the activations' dtype with `dequantize_fp8`, one pass over the weight,
and multiply in cuBLAS: compute-bound there, the extra pass is small beside the product.
Per-tensor scales are served as per-row ones (each row gets its tensor's scale), which keeps the
separate scales of a fused QKV or gate/up projection exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value

__all__ = ["FP8_DTYPE", "FP8_MAX", "check_fp8_weight", "dequantize_fp8", "dequantize_fp8_ref", "quantize_fp8_ref",
           "scale_shape"]


def scale_shape(n: int, k: int, block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scale tensor of an [N, K] weight: [N] per row, or the block grid."""
    if block is None:
        return (n,)
    return (triton.cdiv(n, block[0]), triton.cdiv(k, block[1]))


def check_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> None:
    if weight.dtype != FP8_DTYPE:
        raise TypeError(f"an FP8 weight must be {FP8_DTYPE}, got {weight.dtype}")
    if scale.dtype != torch.float32 and scale.dtype != torch.float64:
        raise TypeError(f"FP8 weight scales must be float32, got {scale.dtype}")
    want = scale_shape(weight.shape[0], weight.shape[1], block)
    if tuple(scale.shape) != want:
        raise ValueError(f"scales of a {tuple(weight.shape)} FP8 weight"
                         f"{'' if block is None else f' in {block} blocks'} must be {want}, got {tuple(scale.shape)}")


def _expanded(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None) -> torch.Tensor:
    if block is None:
        return scale[:, None]
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize_fp8_ref(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                       dtype: torch.dtype) -> torch.Tensor:
    """weight * scale in fp32 (fp64 for fp64), rounded once to `dtype`."""
    check_fp8_weight(weight, scale, block)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    n, k = weight.shape
    return (weight.to(acc) * _expanded(scale.to(acc), n, k, block)).to(dtype)


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_yn, stride_sn, BN_Q, BK_Q,
                       BLOCKED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rn < N)[:, None] & (rk < K)[None, :]
    w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :], mask=ok, other=0.0).to(tl.float32)
    if BLOCKED:
        s = tl.load(s_ptr + (rn // BN_Q)[:, None] * stride_sn + (rk // BK_Q)[None, :], mask=ok, other=0.0)
    else:
        s = tl.load(s_ptr + rn, mask=rn < N, other=0.0)[:, None]
    tl.store(y_ptr + rn.to(tl.int64)[:, None] * stride_yn + rk[None, :], (w * s).to(y_ptr.dtype.element_ty), mask=ok)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """`dequantize_fp8_ref` in one Triton pass: an [N, K] tensor of `dtype`."""
    check_fp8_weight(weight, scale, block)
    n, k = weight.shape
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=weight.device)
    elif tuple(out.shape) != (n, k) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be an [{n}, {k}] {dtype} tensor with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    bn, bk = 32, 128
    _dequantize_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        weight, scale, out, n, k, weight.stride(0), out.stride(0), scale.stride(0),
        *(block if block is not None else (1, 1)), BLOCKED=block is not None, BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out


def quantize_fp8_ref(weight: torch.Tensor, block: tuple[int, int] | None = None,
                     per_tensor: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, fp32 scales) of a float [N, K] weight, each block's (row's, or with
    `per_tensor` the whole tensor's, a 0-d scale) largest magnitude mapped to FP8_MAX, as the
    published checkpoints are made. For tests and benchmarks."""
    w = weight.to(torch.float32)
    n, k = w.shape
    if per_tensor:
        scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
        return (w / scale).to(FP8_DTYPE), scale
    if block is None:
        scale = (w.abs().amax(1) / FP8_MAX).clamp(min=1e-12)
    else:
        gn, gk = scale_shape(n, k, block)
        padded = torch.zeros(gn * block[0], gk * block[1], dtype=torch.float32, device=w.device)
        padded[:n, :k] = w
        amax = padded.view(gn, block[0], gk, block[1]).abs().amax((1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (w / _expanded(scale, n, k, block)).to(FP8_DTYPE), scale
