"""The worker's KV cache, allocated exactly as the plan lays it out: one buffer of blocks, each
block the pages of the plan's layer slots side by side (`[num_blocks, slots, page_bytes]`, bytes).
A layer reads its slot(s) through its group's block tables: an attention layer its page as
`[num_blocks, 2, block_size, kv_heads, head_dim]` (strided: one page of each block; in a packed
page, its own sub-page, from `sub_page` x its page size; a smaller layer on a padded page, the
start of the page), a Mamba layer the pages its state spans as conv and SSM state views. Block 0
is the null block. The attention K/V are in the KV cache dtype (e4m3 for "fp8"), the states in
the model's."""
from __future__ import annotations

import torch
from torch import nn

from distengine.kv_cache.plan import KVCachePlan, LayerPlacement
from distengine.kv_cache.specs import MambaSpec
from distengine.model_config import FP8_KV_CACHE_DTYPES, check_kv_cache_dtype
from kernels.kv_store import FP8_DTYPE


def kv_cache_torch_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The attention K/V's element type: the model's `dtype` for "auto", e4m3 for fp8."""
    check_kv_cache_dtype(kv_cache_dtype)
    return FP8_DTYPE if kv_cache_dtype in FP8_KV_CACHE_DTYPES else dtype


def allocate_kv_cache(plan: KVCachePlan, layers: dict[str, nn.Module], num_blocks: int, dtype: torch.dtype,
                      device: torch.device, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """The pool, bound to every layer of `layers` (plan layer name -> Attention or MambaMixer2);
    `dtype` the model's (the states'), `kv_cache_dtype` the attention K/V's (KV_CACHE_DTYPES)."""
    missing = sorted(set(plan.layer_slots) - set(layers))
    if missing:
        raise ValueError(f"the plan has layers the model lacks: {', '.join(missing[:4])}")
    pool = torch.zeros(num_blocks, plan.num_slots, plan.page_size_bytes, dtype=torch.uint8, device=device)
    mamba = plan.mamba_group_ids
    kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    esize = torch.empty((), dtype=kv_dtype).element_size()
    for name, place in plan.layer_slots.items():
        spec = plan.groups[place.group_id].spec
        layer = layers[name]
        if isinstance(spec, MambaSpec):
            pages = pool[:, place.slot:place.slot + spec.pages].reshape(num_blocks, spec.pages * plan.page_size_bytes)
            layer.bind_state(pages, mamba.index(place.group_id), dtype)
        else:
            layer.bind_kv_cache(_attention_view(pool, place, plan, layer, kv_dtype, esize), place.group_id)
    for name, target in plan.shared_layers.items():
        place = plan.layer_slots[target]
        layers[name].bind_kv_cache(_attention_view(pool, place, plan, layers[name], kv_dtype, esize),
                                   place.group_id, reads_from=layers[target])
    return pool


def _attention_view(pool: torch.Tensor, place: LayerPlacement, plan: KVCachePlan, layer, dtype: torch.dtype,
                    esize: int) -> torch.Tensor:
    """The layer's K/V in every block: `[num_blocks, 2, block_size, kv_heads, head_dim]`, a view of
    its bytes of its slot's page (contiguous within a block, strided across blocks)."""
    spec = plan.groups[place.group_id].spec
    page = 2 * spec.block_size * layer.num_kv_heads * layer.head_dim * esize
    if page != spec.page_size_bytes:
        raise ValueError(f"{layer.layer_name}: the model's page ({page} B) differs from the plan's "
                         f"({spec.page_size_bytes} B): plan and model disagree on KV heads, head size or dtype")
    start = place.sub_page * page
    if start + page > plan.page_size_bytes:
        raise ValueError(f"{layer.layer_name}: sub-page {place.sub_page} of {page} B lies outside the "
                         f"{plan.page_size_bytes} B page")
    raw = pool[:, place.slot, start:start + page]
    return raw.view(dtype).view(pool.shape[0], 2, spec.block_size, layer.num_kv_heads, layer.head_dim)
