"""Paged attention of one layer over its view of a shared group buffer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.kv_store import KVWrite, is_fp8
from workers.ops import paged_attention_op, store_kv_op

if TYPE_CHECKING:
    from workers.mamba_metadata import MambaMetadata


@dataclass
class AttentionMetadata:
    """What every attention layer reads for one step; built once per step by the runner.
    Per KV cache group: a slot for each new token (-1: already cached) and each sequence's
    block table."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context including the new tokens
    max_query_len: int
    max_seq_len: int
    slot_mappings: list[torch.Tensor]  # per group, [num_tokens] int64
    block_tables: list[torch.Tensor]  # per group, [num_seqs, max_blocks] int32
    mamba: MambaMetadata | None = None  # the Mamba layers' state pages (hybrid models)


class Attention(nn.Module):
    """Stores the new tokens' K/V in the layer's slot of the shared buffers, then attends
    through its group's block tables. `kv_cache` and `group_id` are set when the runner
    allocates the cache (`bind_kv_cache`). A layer reading another layer's K/V (the plan's
    `shared_layers`, bound to its target's view) passes k = v = None and stores nothing, as does
    a layer whose rotary launch stored its K/V (`kv_write`). An fp8
    cache keeps K and V as x / scale: the layer's scales come from the checkpoint
    (`set_kv_scales`) or are 1.0, and live on the cache's device as 1-element tensors (a CUDA
    graph reads them in place); a sharing layer reads with its target's."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_name: str,
                 sliding_window: int = 0, chunk_size: int = 0, softcap: float = 0.0,
                 sinks: torch.Tensor | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.layer_name = scale, layer_name
        self.sliding_window, self.chunk_size, self.softcap, self.sinks = sliding_window, chunk_size, softcap, sinks
        self.kv_cache: torch.Tensor | None = None
        self.group_id = -1
        self.kv_scale_values = (1.0, 1.0)
        self.k_scale: torch.Tensor | None = None  # set for an fp8 cache
        self.v_scale: torch.Tensor | None = None

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        if not (k_scale > 0 and v_scale > 0):
            raise ValueError(f"{self.layer_name}: KV cache scales must be > 0, got k {k_scale}, v {v_scale}")
        self.kv_scale_values = (float(k_scale), float(v_scale))
        self.k_scale = self.v_scale = None

    def bind_kv_cache(self, kv_cache: torch.Tensor, group_id: int, reads_from: "Attention | None" = None) -> None:
        """`reads_from`: the layer whose K/V this one reads (KV sharing), and so whose scales."""
        self.kv_cache, self.group_id = kv_cache, group_id
        if not is_fp8(kv_cache):
            self.k_scale = self.v_scale = None
            return
        owner = reads_from or self
        if owner.k_scale is None or owner.k_scale.device != kv_cache.device:
            owner.k_scale, owner.v_scale = (torch.tensor([s], dtype=torch.float32, device=kv_cache.device)
                                            for s in owner.kv_scale_values)
        self.k_scale, self.v_scale = owner.k_scale, owner.v_scale

    def unbind(self) -> None:
        self.kv_cache, self.group_id = None, -1

    def _bound(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError(f"{self.layer_name}: no KV cache bound (allocate the cache before running)")
        return self.kv_cache

    def kv_write(self, v: torch.Tensor, meta: AttentionMetadata) -> KVWrite:
        """This step's K/V store, for the launch that finishes the keys (rotary) to do: the layer
        is then called with k = v = None."""
        n = v.shape[0]
        return KVWrite(v.reshape(n, self.num_kv_heads, self.head_dim), self._bound(), meta.slot_mappings[self.group_id],
                       self.k_scale, self.v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        """k = v = None: nothing to store (a sharing layer, or the keys' launch stored them)."""
        self._bound()
        n = q.shape[0]
        q = q.reshape(n, self.num_heads, self.head_dim)
        if k is not None:
            store_kv_op(k.reshape(n, self.num_kv_heads, self.head_dim), v.reshape(n, self.num_kv_heads, self.head_dim),
                        self.kv_cache, meta.slot_mappings[self.group_id], k_scale=self.k_scale, v_scale=self.v_scale)
        # q may be a view of the fused qkv output: the kernel reads it through its strides.
        out = paged_attention_op(
            q, self.kv_cache, meta.block_tables[self.group_id], meta.query_start_loc, meta.seq_lens,
            meta.max_query_len, meta.max_seq_len, self.scale, sliding_window=self.sliding_window,
            chunk_size=self.chunk_size, softcap=self.softcap, sinks=self.sinks, k_scale=self.k_scale,
            v_scale=self.v_scale)
        return out.reshape(n, self.num_heads * self.head_dim)
