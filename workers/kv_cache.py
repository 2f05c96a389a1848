"""The worker's KV cache, allocated exactly as the plan lays it out: one tensor per buffer (layer
slot), each holding that slot's page of every block; a layer reads its slot through its group's
block tables. Block 0 is the null block."""
from __future__ import annotations

import torch

from distengine.kv_cache.plan import KVCachePlan
from workers.layers.attention import Attention


def allocate_kv_cache(plan: KVCachePlan, attention: dict[str, Attention], num_blocks: int, dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """Buffers `[num_blocks, 2, block_size, kv_heads_per_rank, head_dim]`, bound to every layer."""
    some = next(iter(attention.values()))
    shape = (num_blocks, 2, plan.block_size, some.num_kv_heads, some.head_dim)
    page = 2 * plan.block_size * some.num_kv_heads * some.head_dim * torch.empty((), dtype=dtype).element_size()
    if page != plan.page_size_bytes:
        raise ValueError(f"the model's page ({page} B) differs from the plan's ({plan.page_size_bytes} B): "
                         f"plan and model disagree on KV heads, head size or dtype")
    buffers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(plan.num_slots)]
    for name, (group_id, slot) in plan.layer_slots.items():
        attention[name].bind_kv_cache(buffers[slot], group_id)
    for name, target in plan.shared_layers.items():
        group_id, slot = plan.layer_slots[target]
        attention[name].bind_kv_cache(buffers[slot], group_id)
    return buffers
