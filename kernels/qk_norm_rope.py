"""Per-head RMSNorm of q and k followed by neox rotary, in place, in one launch (Gemma-3 and
Qwen-3 normalise every query and key head before RoPE).

Unfused that is three launches per layer (q norm, k norm, rotary) plus two copies, since the norms
read strided views of the fused qkv output. Here one program takes one token's heads: it loads
each head once, normalises it in fp32, rounds to the tensor's dtype exactly where the unfused path
stores the norm's output (so both give the same numbers), rotates and writes back in place.
Full rotary only (rotary_dim == head_dim); the cos/sin cache is `kernels.rotary`'s.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.layernorm import rms_norm_ref
from kernels.pdl import pdl_args, pdl_wait
from kernels.rotary import rotary_embedding_ref

__all__ = ["qk_norm_rope", "qk_norm_rope_ref"]


@triton.jit
def _norm_rotate(x_ptr, w_ptr, t, n_heads, s_t, s_h, h, j, cos, sin, eps, HALF: tl.constexpr, GEMMA: tl.constexpr):
    m = (h[:, None] < n_heads) & (j[None, :] < HALF)
    p = x_ptr + t * s_t + h[:, None] * s_h + j[None, :]
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    if GEMMA:
        w1 = w1 + 1.0
        w2 = w2 + 1.0
    dt = x_ptr.dtype.element_ty
    # The unfused path stores the norm's output in the tensor's dtype: round there too.
    n1 = (x1 * rstd * w1).to(dt).to(tl.float32)
    n2 = (x2 * rstd * w2).to(dt).to(tl.float32)
    tl.store(p, (n1 * cos - n2 * sin).to(dt), mask=m)
    tl.store(p + HALF, (n2 * cos + n1 * sin).to(dt), mask=m)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, cache_ptr, n_qh, n_kh, sq_t, sq_h, sk_t, sk_h, sc_p,
                         eps, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                         GEMMA: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * sc_p + j, mask=j < HALF).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * sc_p + HALF + j, mask=j < HALF).to(tl.float32)[None, :]
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _norm_rotate(q_ptr, qw_ptr, t, n_qh, sq_t, sq_h, h, j, cos, sin, eps, HALF, GEMMA)
    _norm_rotate(k_ptr, kw_ptr, t, n_kh, sk_t, sk_h, h, j, cos, sin, eps, HALF, GEMMA)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q[T, Hq, D] and k[T, Hk, D] (views of the fused qkv output are fine) are normalised per head
    (weights [D]; Gemma's 1 + weight when `gemma`) and rotated, IN PLACE; returns them."""
    n_tokens, n_qh, head_dim = q.shape
    n_kh = k.shape[1]
    if cos_sin_cache.shape[1] != head_dim or head_dim % 2:
        raise ValueError(f"qk_norm_rope needs full rotary on an even head size (cache {tuple(cos_sin_cache.shape)}, "
                         f"head_dim {head_dim})")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("q, k and the cache need a contiguous last dimension")
    if n_tokens == 0:
        return q, k
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(n_qh, n_kh)), max(1, 2048 // block_half))
    grid = (n_tokens, triton.cdiv(max(n_qh, n_kh), block_h))
    _qk_norm_rope_kernel[grid](q, k, q_weight, k_weight, positions, cos_sin_cache, n_qh, n_kh,
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
                               float(eps), HALF=half, BLOCK_HALF=block_half, BLOCK_H=block_h, GEMMA=gemma,
                               num_warps=4, **pdl_args(q))
    return q, k


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                     gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path (RMSNorm, then rotary), same contract: in place, returns q, k."""
    q.copy_(rms_norm_ref(q, q_weight, eps, gemma=gemma))
    k.copy_(rms_norm_ref(k, k_weight, eps, gemma=gemma))
    return rotary_embedding_ref(q, k, positions, cos_sin_cache)
