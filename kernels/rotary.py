"""Neox-style rotary position embedding (rotate halves), applied in place to q and k.

cos/sin cache layout (as vLLM's `cos_sin_cache`): ONE tensor `[max_position, rotary_dim]`,
row p = [cos(p * inv_freq) | sin(p * inv_freq)] * attention_scaling, each half rotary_dim / 2
wide. One gather per token serves both halves; fp32 is recommended (the kernel computes in fp32
whatever the cache dtype, and the cache is tiny).

Partial rotary (rotary_dim < head_dim): only the first rotary_dim channels of each head rotate,
the rest are left untouched. Models with several RoPE bases (Gemma-3: 10_000 for the sliding
layers, 1_000_000 (+ linear scaling) for the global ones) just build one cache per base and pass
each layer its own.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.kv_store import KVWrite, kv_write_launch, load_kv_write, write_kv_part, write_rotated_keys
from kernels.pdl import pdl_args, pdl_wait

__all__ = ["rotary_embedding", "rotary_embedding_ref", "make_rope_cache", "rope_inv_freq"]


# ----------------------------------------------------------------------------- cache

def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict | None = None,
                  max_position: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim/2] fp32, attention_scaling), computed as
    `transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS` does (same fp32 ops, so the caches
    match HF bit for bit). Accepts HF's dict under either key name ("rope_type" or "type").
    `max_position` is only used by yarn when "factor" is missing (DeepSeek style)."""
    rs = dict(rope_scaling or {})
    kind = rs.get("rope_type", rs.get("type")) or "default"
    dim = rotary_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / rs["factor"], 1.0
    if kind == "proportional":
        # Gemma 4's full layers: the first partial_rotary_factor * dim / 2 frequencies of the
        # whole head (exponents over `dim`), the others 0 (cos 1, sin 0: those channels pairs
        # (i, i + dim/2) stay as they are), all divided by "factor".
        angles = int(rs.get("partial_rotary_factor", 1.0) * dim // 2)
        inv_freq = torch.cat([inv_freq[:angles], torch.zeros(dim // 2 - angles, dtype=torch.float32)])
        return inv_freq / rs.get("factor", 1.0), 1.0
    if kind == "llama3":
        factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old_ctx = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / lo, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) * ~(wavelen > old_ctx / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(dim, base, rs, max_position)
    raise NotImplementedError(f"rope scaling type {kind!r}")


def _yarn(dim: int, base: float, rs: dict, max_position: int | None) -> tuple[torch.Tensor, float]:
    orig = rs["original_max_position_embeddings"]
    factor = rs.get("factor")
    if factor is None:
        assert max_position is not None, "yarn without factor needs max_position"
        factor = max_position / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rs.get("attention_factor")
    if attn is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extra = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv_freq, attn


def make_rope_cache(rotary_dim: int, max_position: int, base: float, rope_scaling: dict | None = None,
                    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> torch.Tensor:
    """`[max_position, rotary_dim]` = [cos | sin] * attention_scaling (layout in the module doc).
    Angles in fp32 like HF and vLLM, so the model sees the phases it was trained with."""
    assert rotary_dim % 2 == 0, rotary_dim
    inv_freq, scaling = rope_inv_freq(rotary_dim, base, rope_scaling, max_position)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * scaling
    return cache.to(dtype=dtype, device=device)


# ----------------------------------------------------------------------------- apply

@triton.jit
def _rotate_heads(x_ptr, t, n_heads, s_t, s_h, h, j, cos, sin, HALF):
    """Rotates heads h of token t in place; returns the two halves as written."""
    m = (h[:, None] < n_heads) & (j[None, :] < HALF)
    p = x_ptr + t * s_t + h[:, None] * s_h + j[None, :]
    x1 = tl.load(p, mask=m).to(tl.float32)
    x2 = tl.load(p + HALF, mask=m).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty)
    tl.store(p, o1, mask=m)
    tl.store(p + HALF, o2, mask=m)
    return o1, o2


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr, n_qh, n_kh, HALF, head_dim,
                 sq_t, sq_h, sk_t, sk_h, sc_p,
                 v_ptr, kv_ptr, slot_ptr, ks_ptr, vs_ptr, sv_t, sv_h, skv_b, skv_kv, skv_s, skv_h, block_size,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, STORE: tl.constexpr,
                 FP8: tl.constexpr, PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    # Before the PDL wait (kernels/pdl.py): the position and slot, a step's inputs written before
    # its forward began, and the cos/sin table, which no kernel writes.
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * sc_p + j, mask=j < HALF).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * sc_p + HALF + j, mask=j < HALF).to(tl.float32)[None, :]
    if STORE:
        slot = tl.load(slot_ptr + t)
    pdl_wait(PDL)
    if STORE:  # loaded first: these loads overlap the chain of q and k
        hk, vm, v = load_kv_write(slot, v_ptr, t, h, n_kh, sv_t, sv_h, head_dim, BLOCK_H, BLOCK_D)
        d = tl.arange(0, BLOCK_D)
        rm = vm & (d[None, :] >= 2 * HALF)  # the dimensions past the rotary width, stored as they are
        k3 = tl.load(k_ptr + t * sk_t + h[:, None] * sk_h + d[None, :], mask=rm)
    _rotate_heads(q_ptr, t, n_qh, sq_t, sq_h, h, j, cos, sin, HALF)
    k1, k2 = _rotate_heads(k_ptr, t, n_kh, sk_t, sk_h, h, j, cos, sin, HALF)
    if STORE:
        m = hk & (j[None, :] < HALF)
        write_kv_part(kv_ptr, slot, h, d, vm, v, vs_ptr, skv_b, skv_kv, skv_s, skv_h, block_size, 1, FP8)
        write_kv_part(kv_ptr, slot, h, d, rm, k3, ks_ptr, skv_b, skv_kv, skv_s, skv_h, block_size, 0, FP8)
        write_rotated_keys(kv_ptr, slot, h, j, m, k1, k2, HALF, ks_ptr, skv_b, skv_kv, skv_s, skv_h, block_size, FP8)


def _check(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor, cache: torch.Tensor) -> int:
    rot = cache.shape[1]
    assert q.dim() == 3 and positions.shape == (q.shape[0],), (q.shape, positions.shape)
    assert rot % 2 == 0 and rot <= q.shape[2], (rot, q.shape)
    assert k is None or (k.dim() == 3 and k.shape[0] == q.shape[0] and k.shape[2] == q.shape[2])
    return rot


def rotary_embedding(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor,
                     kv_write: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotates q[T,Hq,D] and k[T,Hk,D] IN PLACE (they may be strided views of the fused qkv
    output, e.g. `qkv[:, :Hq*D].view(T, Hq, D)`: writing through them avoids a copy) and returns
    the same tensors. k may be None (layers that reuse another layer's KV). One program per
    (token, head tile) so cos/sin are gathered once and reused by every q and k head. With
    `kv_write` (and k), the rotated keys and its values are stored in its cache too."""
    rot = _check(q, k, positions, cos_sin_cache)
    assert q.stride(2) == 1 and (k is None or k.stride(2) == 1), "head_dim must be contiguous"
    assert cos_sin_cache.stride(1) == 1
    if kv_write is not None:
        kv_write.check(k)
    n_tokens, n_qh, head_dim = q.shape
    n_kh = k.shape[1] if k is not None else 0
    if n_tokens == 0:
        return q, k
    kk = k if k is not None else q  # Hk = 0 masks every k access
    half = rot // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(max(n_qh, n_kh)), max(1, 1024 // block_half))
    grid = (n_tokens, triton.cdiv(max(n_qh, n_kh), block_h))
    store, flags = kv_write_launch(kv_write, q, positions)
    _rope_kernel[grid](q, kk, positions, cos_sin_cache, n_qh, n_kh, half, head_dim,
                       q.stride(0), q.stride(1), kk.stride(0), kk.stride(1), cos_sin_cache.stride(0), *store,
                       BLOCK_H=block_h, BLOCK_HALF=block_half, BLOCK_D=triton.next_power_of_2(head_dim), **flags,
                       num_warps=4, **pdl_args(q))
    return q, k


def rotary_embedding_ref(q: torch.Tensor, k: torch.Tensor | None, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor,
                         kv_write: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as `rotary_embedding` (in place, returns q, k). fp32 math (fp64 for fp64)."""
    if kv_write is not None:
        kv_write.check(k)
        rotary_embedding_ref(q, k, positions, cos_sin_cache)
        kv_write.store_ref(k)
        return q, k
    rot = _check(q, k, positions, cos_sin_cache)
    half = rot // 2
    acc = torch.promote_types(q.dtype, torch.float32)
    cs = cos_sin_cache[positions].to(acc)[:, None, :]  # [T, 1, rot]
    cos, sin = cs[..., :half], cs[..., half:]
    for x in (q, k) if k is not None else (q,):
        x1, x2 = x[..., :half].to(acc), x[..., half:rot].to(acc)
        x[..., :rot] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return q, k
