"""Write the new tokens' K and V into the paged KV cache (vLLM's `reshape_and_cache_flash`).

Layout (kernels/README.md): `kv_cache[num_blocks, 2, block_size, num_kv_heads, head_dim]`, and
token t goes to block `slot_mapping[t] // block_size`, offset `slot_mapping[t] % block_size`.
A slot of -1 means the token's KV is already cached (prefix-cache hit) and is not written.

An fp8 cache (`torch.float8_e4m3fn`, vLLM's kv_cache_dtype "fp8") stores each element as
x / scale, saturated to the format's +-448, with one scale for K and one for V (1-element
float32 tensors on the cache's device, so a CUDA graph reads them where they are); readers
multiply back (`kernels.paged_attention`).

An fp8 cache also orders each block's values differently (`value_group`): in groups of 16 slots,
each group [num_kv_heads, head_dim, 16], so that a head's dimension holds 16 consecutive tokens'
bytes side by side. Attention multiplies P [rows, keys] by V [keys, head_dim]: the product's
operand wants each thread's few values of one dimension for consecutive keys. From the usual
[slot, head, dim] order a bf16 tile gets them with a transposing shared-memory load
(`ldmatrix.trans`), which has no 8-bit form on Hopper, so Triton read an e4m3 tile a byte at a
time: 256 shared-memory loads a thread per 32-key tile, 40% of the decode loop's instructions.
With the groups the tile is loaded in 16-byte runs of keys and needs no transpose, and a
prefill's e4m3 product takes it as stored. H200, one layer's attention, Gemma-3-12B's heads,
against the usual order: decode B=128 x 8,192 keys 973 against 1,191 us, window 1,024: 141
against 190; a prefill of 8,192 tokens 2,510 against 2,259, window 1,024: 739 against 613
(`docs/performance.md`). Keys keep the usual order (their product's operand
wants consecutive dimensions, which that order has). A block size that is not a multiple of 16
keeps the usual order for values too (a group of one slot).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_args, pdl_wait

__all__ = ["store_kv", "store_kv_ref", "FP8_DTYPE", "FP8_MAX", "KVWrite", "VALUE_GROUP", "is_fp8", "kv_write_launch",
           "load_kv_write", "quantize_fp8_ref", "value_group", "value_offsets", "values_view", "write_kv_part",
           "write_rotated_keys"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value (it has no infinity: larger values would be NaN)


def is_fp8(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype == FP8_DTYPE


VALUE_GROUP = tl.constexpr(16)


def value_group(kv_cache: torch.Tensor) -> int:
    """The slots of a value group (module docstring): 16 in an fp8 cache whose block size is a
    multiple of 16, else 1 (the usual [slot, head, dim] order)."""
    g = VALUE_GROUP.value
    return g if is_fp8(kv_cache) and kv_cache.shape[2] % g == 0 else 1


@triton.jit
def value_offsets(s, h, cols, sc_s, sc_h, GROUPED):
    """Where the values of slot s (in its block), heads h, columns cols sit in a block's V half
    whose usual strides are sc_s (a slot) and sc_h (a head): in groups of VALUE_GROUP slots when
    GROUPED (`value_group` > 1), else the usual order. Arguments broadcast."""
    if GROUPED:
        off = ((s // VALUE_GROUP) * (VALUE_GROUP * sc_s) + h * (VALUE_GROUP * sc_h) + cols * VALUE_GROUP
               + s % VALUE_GROUP)
    else:
        off = s * sc_s + h * sc_h + cols
    return off


def values_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The V half of the cache as [num_blocks, block_size // G, num_kv_heads, head_dim, G] (G =
    `value_group`); an fp8 cache's as bytes (not every torch build indexes float8 tensors).
    Index [blocks, slots // G, :, :, slots % G] for the values [n, num_kv_heads, head_dim]."""
    nb, _, bs, h, d = kv_cache.shape
    g = value_group(kv_cache)
    v = kv_cache[:, 1]
    if is_fp8(kv_cache):
        v = v.view(torch.uint8)
    if v.stride(1) != h * d or v.stride(2) != d or v.stride(3) != 1:
        raise ValueError(f"a cache's values need their [block_size, heads, head_dim] contiguous, got strides "
                         f"{tuple(v.stride())}")
    return v.view(nb, bs // g, g, h, d).permute(0, 1, 3, 4, 2) if g == 1 else v.view(nb, bs // g, h, d, g)


def check_scales(kv_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """An fp8 cache needs its two scales (1-element float32 tensors on its device); others none."""
    if not is_fp8(kv_cache):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale apply to an fp8 KV cache, not a {kv_cache.dtype} one")
        return
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.numel() != 1 or s.dtype != torch.float32 or s.device != kv_cache.device:
            raise ValueError(f"an fp8 KV cache needs {name} as a 1-element float32 tensor on {kv_cache.device}, "
                             f"got {None if s is None else (tuple(s.shape), s.dtype, str(s.device))}")


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in e4m3, rounded to nearest (ties to even), saturated to +-448."""
    return (x.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _check(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
           k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    assert key.dim() == 3 and key.shape == value.shape, (key.shape, value.shape)
    assert kv_cache.dim() == 5 and kv_cache.shape[1] == 2, kv_cache.shape
    assert kv_cache.shape[3:] == key.shape[1:], (kv_cache.shape, key.shape)
    assert slot_mapping.shape == (key.shape[0],), (slot_mapping.shape, key.shape)
    check_scales(kv_cache, k_scale, v_scale)


@dataclass(frozen=True)
class KVWrite:
    """The new tokens' V and where their K and V go: what `store_kv` takes besides the keys, for
    a launch that computes the keys (rotary, `kernels.qk_norm_rope`) and stores them itself,
    which saves the store's own launch."""

    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    def check(self, key: torch.Tensor | None) -> None:
        if key is None:
            raise ValueError("a KV write needs the keys (a layer that reads another layer's K/V stores none)")
        _check(key, self.value, self.kv_cache, self.slot_mapping, self.k_scale, self.v_scale)
        if self.value.stride(-1) != 1 or self.kv_cache.stride(-1) != 1:
            raise ValueError("the values and the KV cache need a contiguous last dimension")

    def store_ref(self, key: torch.Tensor) -> None:
        """What the fused launch writes, the torch way (`store_kv_ref`)."""
        store_kv_ref(key, self.value, self.kv_cache, self.slot_mapping, self.k_scale, self.v_scale)


def kv_write_launch(kv_write: KVWrite | None, dummy: torch.Tensor, dummy_index: torch.Tensor) -> tuple[tuple, dict]:
    """What a rotary kernel takes for `kv_write` after its own arguments: the value, cache, slots,
    the two scales (the value where the cache has none), the value's token and head strides, the
    cache's strides and block size (see `write_kv_part`), placeholders where there is no write;
    and its STORE and FP8 flags."""
    if kv_write is None:
        return (dummy, dummy, dummy_index, dummy, dummy, 0, 0, 0, 0, 0, 0, 1), {"STORE": False, "FP8": False}
    fp8 = is_fp8(kv_write.kv_cache)
    v, c = kv_write.value, kv_write.kv_cache
    args = (v, c, kv_write.slot_mapping, kv_write.k_scale if fp8 else v, kv_write.v_scale if fp8 else v,
            v.stride(0), v.stride(1), c.stride(0), c.stride(1), c.stride(2), c.stride(3), c.shape[2])
    return args, {"STORE": True, "FP8": fp8}


@triton.jit
def _cache_value(x, scale_ptr, FP8: tl.constexpr):
    """x as the cache holds it: in an fp8 cache x / scale, rounded (div_rn: the same e4m3 values
    as the torch reference, not an approximation) and saturated to +-448."""
    if FP8:
        x = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
        x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    return x


@triton.jit
def write_kv_part(cache_ptr, slot, h, cols, mask, x, scale_ptr, sc_b, sc_kv, sc_s, sc_h, block_size,
                  KV: tl.constexpr, FP8: tl.constexpr):
    """Stores x [heads, cols] (KV: 0 for keys, 1 for values) of the token at `slot` (>= 0), heads
    `h`, columns `cols` of each head; an fp8 cache's values in their groups (`value_offsets`).
    The block index is int64: no overflow past 2^31 elements."""
    slot = slot.to(tl.int64)
    s = slot % block_size
    if FP8 and KV == 1:  # grouped exactly where `value_group` says (block_size is not a constexpr)
        off = value_offsets(s, h[:, None], cols[None, :], sc_s, sc_h, block_size % VALUE_GROUP == 0)
    else:
        off = value_offsets(s, h[:, None], cols[None, :], sc_s, sc_h, False)
    dst = cache_ptr + (slot // block_size) * sc_b + KV * sc_kv + off
    tl.store(dst, _cache_value(x, scale_ptr, FP8).to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_kv_write(slot, v_ptr, t, h, n_kv_heads, sv_t, sv_h, head_dim, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """What a launch that stores token t's K/V at `slot` (read before its PDL wait: a step's
    input) reads first, so that these loads overlap its own chain: the mask of the heads h to
    store [BLOCK_H, 1] (none for slot -1, a prefix-cache hit already cached), the values' mask and
    the values [BLOCK_H, BLOCK_D]."""
    # (the interpreter rejects mask & scalar)
    hk = (h[:, None] < n_kv_heads) & (tl.zeros([BLOCK_H, 1], tl.int64) + slot >= 0)
    d = tl.arange(0, BLOCK_D)
    vm = hk & (d[None, :] < head_dim)
    v = tl.load(v_ptr + t * sv_t + h[:, None] * sv_h + d[None, :], mask=vm)
    return hk, vm, v


@triton.jit
def write_rotated_keys(cache_ptr, slot, h, j, m, k1, k2, HALF, scale_ptr, sc_b, sc_kv, sc_s, sc_h, block_size,
                       FP8: tl.constexpr):
    """Stores the two rotated halves k1, k2 [heads, len(j)] of the keys (mask m): columns j and HALF + j."""
    write_kv_part(cache_ptr, slot, h, j, m, k1, scale_ptr, sc_b, sc_kv, sc_s, sc_h, block_size, 0, FP8)
    write_kv_part(cache_ptr, slot, h, HALF + j, m, k2, scale_ptr, sc_b, sc_kv, sc_s, sc_h, block_size, 0, FP8)


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                     num_heads, head_dim, block_size,
                     sk_t, sk_h, sv_t, sv_h, sc_b, sc_kv, sc_s, sc_h,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # prefix-cache hit: the cache already holds this token's KV
        return
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_heads) & (d[None, :] < head_dim)
    k = tl.load(key_ptr + t * sk_t + h[:, None] * sk_h + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * sv_t + h[:, None] * sv_h + d[None, :], mask=mask)
    write_kv_part(cache_ptr, slot, h, d, mask, k, k_scale_ptr, sc_b, sc_kv, sc_s, sc_h, block_size, 0, FP8)
    write_kv_part(cache_ptr, slot, h, d, mask, v, v_scale_ptr, sc_b, sc_kv, sc_s, sc_h, block_size, 1, FP8)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Writes in place into `kv_cache`, which may be a strided view of a group buffer (its
    strides are passed to the kernel, nothing is copied). One program per (token, head tile):
    the tile is capped at ~2K elements so wide heads x many heads still fit in registers.
    An fp8 cache takes `k_scale` and `v_scale`."""
    _check(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 2048 // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    fp8 = is_fp8(kv_cache)
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("store_kv needs keys, values and the cache with a contiguous last dimension")
    _store_kv_kernel[grid](key, value, kv_cache, slot_mapping, k_scale if fp8 else key, v_scale if fp8 else key,
                           num_heads, head_dim, kv_cache.shape[2], key.stride(0), key.stride(1),
                           value.stride(0), value.stride(1), *kv_cache.stride()[:4],
                           BLOCK_H=block_h, BLOCK_D=block_d, FP8=fp8, num_warps=4 if block_h * block_d >= 1024 else 2,
                           **pdl_args(key))


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    """Same contract as `store_kv`, as one index_put per K and V (what runs on CPU)."""
    _check(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blk, off = slots // block_size, slots % block_size
    # kv_cache[:, i] is a view, so the index_put writes through to the (possibly strided) cache.
    if is_fp8(kv_cache):  # as bytes: not every torch build indexes float8 tensors
        g = value_group(kv_cache)
        kv_cache.view(torch.uint8)[:, 0][blk, off] = quantize_fp8_ref(key[keep], k_scale).view(torch.uint8)
        values_view(kv_cache)[blk, off // g, :, :, off % g] = quantize_fp8_ref(value[keep], v_scale).view(torch.uint8)
        return
    kv_cache[:, 0][blk, off] = key[keep].to(kv_cache.dtype)
    kv_cache[:, 1][blk, off] = value[keep].to(kv_cache.dtype)
