"""Paged attention of one layer over its view of a shared group buffer."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels.kv_store import KVWrite, is_fp8
from workers.ops import cudnn_attention_available, paged_attention_op, prompt_attention_op, store_kv_op

if TYPE_CHECKING:
    from workers.mamba_metadata import MambaMetadata

logger = logging.getLogger(__name__)

# A step of more prompts keeps the paged kernel's one launch (the route makes one call a prompt).
PROMPT_ROUTE_MAX_SEQS = 8


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
    # Host query lengths when every sequence starts at position 0 (its keys are all this step's):
    # such a step may attend on its own K/V (`Attention.forward`).
    prompt_lens: tuple[int, ...] | None = None
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
        self.prompt_declined = 0  # route calls that cuDNN declined (each ran the paged kernel)

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

    def takes_prompt_route(self, q: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step attends on its own K/V through cuDNN (`prompt_attention_op`): a step
        of at most PROMPT_ROUTE_MAX_SEQS whole prompts, plain causal attention (no window, local
        chunks, soft-capping or sinks), a 16-bit cache and heads of at most 256."""
        return (meta.prompt_lens is not None and len(meta.prompt_lens) <= PROMPT_ROUTE_MAX_SEQS
                and q.dtype in (torch.bfloat16, torch.float16) and not is_fp8(self._bound())
                and not (self.sliding_window or self.chunk_size or self.softcap) and self.sinks is None
                and self.head_dim <= 256 and self.head_dim % 8 == 0 and cudnn_attention_available(q.device))

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                meta: AttentionMetadata, stored: bool = False) -> torch.Tensor:
        """k = v = None: nothing to store and no K/V of this step to attend on (a sharing layer).
        `stored`: k and v are already in the cache (the keys' launch stored them), given for the
        prompt route."""
        self._bound()
        n = q.shape[0]
        q = q.reshape(n, self.num_heads, self.head_dim)
        if k is not None:
            k = k.reshape(n, self.num_kv_heads, self.head_dim)
            v = v.reshape(n, self.num_kv_heads, self.head_dim)
            if not stored:
                store_kv_op(k, v, self.kv_cache, meta.slot_mappings[self.group_id], k_scale=self.k_scale,
                            v_scale=self.v_scale)
            if self.takes_prompt_route(q, meta):
                try:
                    return prompt_attention_op(q, k, v, meta.prompt_lens, self.scale).reshape(n, -1)
                except RuntimeError as e:  # a cuDNN build that declines the shape: this step's paged kernel
                    if not self.prompt_declined:
                        logger.warning("%s: cuDNN attention declined (%s); the paged kernel ran", self.layer_name,
                                       str(e).splitlines()[0] if str(e) else type(e).__name__)
                    self.prompt_declined += 1
        # q may be a view of the fused qkv output: the kernel reads it through its strides.
        out = paged_attention_op(
            q, self.kv_cache, meta.block_tables[self.group_id], meta.query_start_loc, meta.seq_lens,
            meta.max_query_len, meta.max_seq_len, self.scale, sliding_window=self.sliding_window,
            chunk_size=self.chunk_size, softcap=self.softcap, sinks=self.sinks, k_scale=self.k_scale,
            v_scale=self.v_scale)
        return out.reshape(n, self.num_heads * self.head_dim)
