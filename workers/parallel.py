"""Tensor parallelism: the rank's place in its group, and the two collectives a layer needs.

A `TPGroup` is passed to every layer that shards or reduces (no global state): a single-process
group (world size 1) makes every collective a no-op, so the same model code runs unsharded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed process group; None: the default group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


def init_tp_group(rank: int, world_size: int, init_method: str, backend: str | None = None) -> TPGroup:
    """Join the process group (NCCL on GPUs, gloo on CPU) from an address the engine chose."""
    if world_size == 1:
        return TPGroup()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return TPGroup(rank, world_size)


def split_evenly(n: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """(start, size) of this rank's share of n items; a clear error when tp does not divide n."""
    if n % tp.world_size:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {tp.world_size}")
    size = n // tp.world_size
    return tp.rank * size, size


def kv_head_share(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """(first KV head, count) of this rank: split when tp <= heads, else one head per rank,
    replicated across tp // heads consecutive ranks."""
    if tp.world_size <= num_kv_heads:
        return split_evenly(num_kv_heads, tp, "KV heads")
    if tp.world_size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated over tensor-parallel size {tp.world_size}")
    return tp.rank // (tp.world_size // num_kv_heads), 1
