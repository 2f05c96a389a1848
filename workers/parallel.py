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
    custom: Any = None  # a faster all-reduce for small GPU tensors (SymmMemAllReduce), or None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group: in place through NCCL, or a new tensor through `custom`."""
        if self.world_size > 1:
            if self.custom is not None:
                out = self.custom(x)
                if out is not None:
                    return out
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:  # one output tensor, one collective (what a CUDA graph captures best)
            out = torch.empty((self.world_size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            return torch.cat(out.unbind(0), dim=dim)
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


class SymmMemAllReduce:
    """A one-shot all-reduce over NVLink for the small tensors of decode steps: each rank copies
    its tensor into a symmetric buffer and one kernel sums every peer's buffer with peer-to-peer
    loads (torch symmetric memory; no multicast). Its kernel waits for every rank on entry and on
    exit, so one buffer serves call after call; it runs inside CUDA graphs. Larger tensors, other
    dtypes and CPU tensors return None: the caller uses NCCL."""

    def __init__(self, device: torch.device, dtype: torch.dtype, max_bytes: int, group: Any = None) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.group_name = (group or dist.group.WORLD).group_name
        self.dtype = dtype
        self.max_numel = max_bytes // torch.empty((), dtype=dtype).element_size()
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.8
        if enable is not None:
            enable(self.group_name)
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        n = x.numel()
        if not x.is_cuda or x.dtype != self.dtype or n > self.max_numel or not x.is_contiguous():
            return None
        buf = self.buffer[:n]
        buf.copy_(x.view(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name).view_as(x)


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
