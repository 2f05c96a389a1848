"""Per-head RMSNorm of q and k followed by neox rotary, in place, in one launch (Gemma-3 and
Qwen-3 normalise every query and key head before RoPE; Qwen3-Next and Qwen3.5 rotate only the
first quarter of each head).

Unfused that is three launches per layer (q norm, k norm, rotary) plus two copies, since the norms
read strided views of the fused qkv output. Here one program takes one token's heads: it loads
each head once, normalises it in fp32, rounds to the tensor's dtype exactly where the unfused path
stores the norm's output (so both give the same numbers), rotates the first rotary_dim dimensions
(the cos/sin cache's width, `kernels.rotary`'s layout) and writes back in place. Given a
`KVWrite`, the same programs also store the finished keys and the values in the paged KV cache
(`kernels.kv_store`'s layout and rounding): the store's own launch is saved.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.kv_store import KVWrite, kv_write_launch, load_kv_write, write_kv_part, write_rotated_keys
from kernels.layernorm import rms_norm_ref
from kernels.pdl import pdl_args, pdl_wait
from kernels.rotary import rotary_embedding_ref

__all__ = ["qk_norm_rope", "qk_norm_rope_ref"]


@triton.jit
def _norm_weights(w_ptr, j, r, HALF: tl.constexpr, REST: tl.constexpr, GEMMA: tl.constexpr):
    """A head norm's weights as `_norm_rotate` takes them: the two rotated halves and the rest
    ([1, len(j)], [1, len(j)], [1, len(r)] fp32; Gemma's 1 + w)."""
    w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    w3 = tl.load(w_ptr + 2 * HALF + r, mask=r < REST, other=0.0).to(tl.float32)[None, :]
    if GEMMA:
        w1 = w1 + 1.0
        w2 = w2 + 1.0
        w3 = w3 + 1.0
    return w1, w2, w3


@triton.jit
def _norm_rotate(x_ptr, w, t, n_heads, s_t, s_h, h, j, r, cos, sin, eps, HALF: tl.constexpr, REST: tl.constexpr):
    """Heads h of token t: normalised by the weights w (`_norm_weights`), the first 2 HALF
    dimensions rotated, the REST after them passed through; written in place. Returns the three
    parts as written (dtype values, fp32)."""
    head_dim = 2 * HALF + REST
    m = (h[:, None] < n_heads) & (j[None, :] < HALF)
    mr = (h[:, None] < n_heads) & (r[None, :] < REST)
    p = x_ptr + t * s_t + h[:, None] * s_h + j[None, :]
    pr = x_ptr + t * s_t + h[:, None] * s_h + 2 * HALF + r[None, :]
    x1 = tl.load(p, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m, other=0.0).to(tl.float32)
    x3 = tl.load(pr, mask=mr, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(x3 * x3, 1)) / head_dim + eps)[:, None]
    w1, w2, w3 = w
    dt = x_ptr.dtype.element_ty
    # The unfused path stores the norm's output in the tensor's dtype: round there too.
    n1 = (x1 * rstd * w1).to(dt).to(tl.float32)
    n2 = (x2 * rstd * w2).to(dt).to(tl.float32)
    o1 = (n1 * cos - n2 * sin).to(dt)
    o2 = (n2 * cos + n1 * sin).to(dt)
    o3 = (x3 * rstd * w3).to(dt)
    tl.store(p, o1, mask=m)
    tl.store(p + HALF, o2, mask=m)
    tl.store(pr, o3, mask=mr)
    return o1, o2, o3


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, cache_ptr, n_qh, n_kh, sq_t, sq_h, sk_t, sk_h, sc_p,
                         eps, v_ptr, kv_ptr, slot_ptr, ks_ptr, vs_ptr, sv_t, sv_h, skv_b, skv_kv, skv_s, skv_h,
                         block_size, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, REST: tl.constexpr,
                         BLOCK_REST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         GEMMA: tl.constexpr, STORE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    # Before the PDL wait (kernels/pdl.py): the position and slot, a step's inputs written before
    # its forward began, and the cos/sin table and norm weights, which no kernel writes.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    r = tl.arange(0, BLOCK_REST)
    cos = tl.load(cache_ptr + pos * sc_p + j, mask=j < HALF).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * sc_p + HALF + j, mask=j < HALF).to(tl.float32)[None, :]
    qw = _norm_weights(qw_ptr, j, r, HALF, REST, GEMMA)
    kw = _norm_weights(kw_ptr, j, r, HALF, REST, GEMMA)
    if STORE:
        slot = tl.load(slot_ptr + t)
    pdl_wait(PDL)
    if STORE:  # loaded first: these loads overlap the chain of q and k
        hk, vm, v = load_kv_write(slot, v_ptr, t, h, n_kh, sv_t, sv_h, 2 * HALF + REST, BLOCK_H, BLOCK_D)
    _norm_rotate(q_ptr, qw, t, n_qh, sq_t, sq_h, h, j, r, cos, sin, eps, HALF, REST)
    k1, k2, k3 = _norm_rotate(k_ptr, kw, t, n_kh, sk_t, sk_h, h, j, r, cos, sin, eps, HALF, REST)
    if STORE:
        write_kv_part(kv_ptr, slot, h, tl.arange(0, BLOCK_D), vm, v, vs_ptr, skv_b, skv_kv, skv_s, skv_h, block_size,
                      1, FP8)
        write_rotated_keys(kv_ptr, slot, h, j, hk & (j[None, :] < HALF), k1, k2, HALF, ks_ptr, skv_b, skv_kv, skv_s,
                           skv_h, block_size, FP8)
        write_kv_part(kv_ptr, slot, h, 2 * HALF + r, hk & (r[None, :] < REST), k3, ks_ptr, skv_b, skv_kv, skv_s,
                      skv_h, block_size, 0, FP8)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                 q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 gemma: bool = False, kv_write: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q[T, Hq, D] and k[T, Hk, D] (views of the fused qkv output are fine) are normalised per head
    (weights [D]; Gemma's 1 + weight when `gemma`) and their first rotary_dim dimensions (the
    cache's width, even, at most D) rotated, IN PLACE; returns them. With `kv_write`, the keys as
    written and its values are stored in its cache too."""
    n_tokens, n_qh, head_dim = q.shape
    n_kh = k.shape[1]
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > head_dim or k.shape[0] != n_tokens or k.shape[2] != head_dim:
        raise ValueError(f"qk_norm_rope needs an even rotary width up to the head size and q, k of one head size "
                         f"(cache {tuple(cos_sin_cache.shape)}, q {tuple(q.shape)}, k {tuple(k.shape)})")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_sin_cache.stride(1) != 1:
        raise ValueError("q, k and the cache need a contiguous last dimension")
    if kv_write is not None:
        kv_write.check(k)
    if n_tokens == 0:
        return q, k
    half, rest = rot // 2, head_dim - rot
    block_half = triton.next_power_of_2(half)
    block_rest = triton.next_power_of_2(max(rest, 1))
    # ~4K elements of heads a program (16 heads of 256)
    per_head = 2 * block_half + (block_rest if rest else 0)
    block_h = min(triton.next_power_of_2(max(n_qh, n_kh)), 1 << (max(1, 4096 // per_head).bit_length() - 1))
    grid = (n_tokens, triton.cdiv(max(n_qh, n_kh), block_h))
    store, flags = kv_write_launch(kv_write, q, positions)
    _qk_norm_rope_kernel[grid](q, k, q_weight, k_weight, positions, cos_sin_cache, n_qh, n_kh,
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
                               float(eps), *store, HALF=half, BLOCK_HALF=block_half, REST=rest, BLOCK_REST=block_rest,
                               BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(head_dim), GEMMA=gemma, **flags,
                               num_warps=4, **pdl_args(q))
    return q, k


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                     gemma: bool = False, kv_write: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused path (RMSNorm, then rotary, then the store), same contract: in place, returns q, k."""
    q.copy_(rms_norm_ref(q, q_weight, eps, gemma=gemma))
    k.copy_(rms_norm_ref(k, k_weight, eps, gemma=gemma))
    rotary_embedding_ref(q, k, positions, cos_sin_cache)
    if kv_write is not None:
        kv_write.store_ref(k)
    return q, k
