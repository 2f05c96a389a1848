"""Tensor parallelism: the rank's place in its group, and the two collectives a layer needs.

A `TPGroup` is passed to every layer that shards or reduces (no global state): a single-process
group (world size 1) makes every collective a no-op, so the same model code runs unsharded.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # torch.distributed process group; None: the default group
    custom: Any = None  # a faster all-reduce for small GPU tensors (NVLinkAllReduce), or None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group: in place through NCCL, or a new tensor through `custom`."""
        if self.world_size > 1:
            if self.custom is not None:
                out = self.custom(x)
                if out is not None:
                    return out
            dist.all_reduce(x, group=self.group)
        return x

    def reduce_buffer(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Where a partial product about to be all-reduced should be written (the NVLink
        all-reduce's buffer), or None: any new tensor will do."""
        if self.world_size > 1 and self.custom is not None:
            return self.custom.buffer_for(rows, cols, dtype, device)
        return None

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


class NVLinkAllReduce:
    """The all-reduce of decode-sized tensors over NVLink: each rank's partial sums sit in its
    buffer of a torch symmetric-memory allocation (peer-to-peer mapped, no multicast) and one
    kernel (`kernels.allreduce`) sums every peer's rows and, where the layer asks, applies the
    norms and the residual add that follow. A row-parallel layer writes its product straight into
    the buffer (`buffer_for`), so nothing is copied; the kernel waits for every rank on entry and
    on exit, so one buffer serves call after call, inside CUDA graphs too. Tensors too large,
    of another dtype, or on the CPU get None back: the caller uses NCCL."""

    MAX_PROGRAMS = 128  # one program per row up to this many rows; the rest loop
    MAX_COLS = 16384  # a row is one program's block of registers

    def __init__(self, device: torch.device, dtype: torch.dtype, max_bytes: int, group: Any = None) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from kernels.allreduce import PeerBuffers, pad_slots
        group_name = (group or dist.group.WORLD).group_name
        self.dtype, self.device = dtype, device
        self.max_numel = max_bytes // torch.empty((), dtype=dtype).element_size()
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)  # needed before torch 2.8
        if enable is not None:
            enable(group_name)
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        buffers = symm_mem.rendezvous(self.buffer, group_name)
        world = buffers.world_size
        # The kernel's flag arrays: a symmetric int32 allocation of their own, zero on every rank
        # before any rank signals (zeroed, then one barrier).
        self.flags = symm_mem.empty(pad_slots(self.MAX_PROGRAMS, world), dtype=torch.int32, device=device)
        flags = symm_mem.rendezvous(self.flags, group_name)
        self.flags.zero_()
        torch.cuda.synchronize(device)
        dist.barrier(group=group)
        as_tensor = lambda ptrs: torch.tensor(list(ptrs), dtype=torch.int64, device=device)  # noqa: E731
        self.peers = PeerBuffers(as_tensor(buffers.buffer_ptrs), as_tensor(flags.buffer_ptrs), buffers.rank, world,
                                 self.MAX_PROGRAMS)

    def buffer_for(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """Where a [rows, cols] partial product should be written to be reduced without a copy,
        or None when this all-reduce cannot take it."""
        if dtype != self.dtype or device != self.device or rows * cols > self.max_numel or rows * cols == 0:
            return None
        return self.buffer[: rows * cols].view(rows, cols)

    def _rows_in_buffer(self, x: torch.Tensor) -> tuple[int, int] | None:
        """x's rows copied into the buffer where they are not already: (rows, cols), or None
        when this all-reduce cannot take x (the caller uses NCCL)."""
        if not x.is_cuda or x.dim() < 2 or not 0 < x.shape[-1] <= self.MAX_COLS:
            return None
        cols = x.shape[-1]
        rows = x.numel() // cols
        buf = self.buffer_for(rows, cols, x.dtype, x.device)
        if buf is None:
            return None
        if x.data_ptr() != buf.data_ptr() or not x.is_contiguous():
            buf.copy_(x.reshape(rows, cols))
        return rows, cols

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        from kernels.allreduce import all_reduce_rows
        shape = self._rows_in_buffer(x)
        if shape is None:
            return None
        return all_reduce_rows(self.peers, *shape, x.dtype, x.device).view(x.shape)

    def reduce_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: torch.Tensor, eps: float,
                    gemma: bool, pre_norm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(norm(pre_norm(sum(x)) + residual), the stream after the add) in one kernel, or None."""
        from kernels.allreduce import all_reduce_rows
        if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
            return None
        shape = self._rows_in_buffer(x)
        if shape is None:
            return None
        out, new_res = all_reduce_rows(self.peers, *shape, x.dtype, x.device, residual=residual.view(shape),
                                       norm1=pre_norm, norm2=norm, eps=eps, gemma=gemma)
        return out.view(x.shape), new_res.view(x.shape)


def init_tp_group(rank: int, world_size: int, init_method: str, backend: str | None = None) -> TPGroup:
    """Join the process group (NCCL on GPUs, gloo on CPU) from an address the engine chose."""
    if world_size == 1:
        return TPGroup()
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return TPGroup(rank, world_size)


# Tensors up to this size take the NVLink one-shot all-reduce (a decode step's, up to a few hundred
# sequences); larger ones (prefills) NCCL.
CUSTOM_ALL_REDUCE_MAX_BYTES = 1 << 20


def with_nvlink_all_reduce(tp: TPGroup, device: torch.device, dtype: torch.dtype) -> TPGroup:
    """`tp` with the NVLink all-reduce for decode-sized tensors where every rank's GPUs can do it,
    else as it is (NCCL only). A collective: every rank calls it."""
    import sys
    custom = None
    try:
        custom = NVLinkAllReduce(device, dtype, CUSTOM_ALL_REDUCE_MAX_BYTES)
    except Exception as e:  # noqa: BLE001 - no P2P, no symmetric memory: NCCL does it all
        print(f"rank {tp.rank}: the NVLink all-reduce is unavailable ({type(e).__name__}: {e}); using NCCL",
              file=sys.stderr)
    # Every rank or none: one rank in the NVLink kernel while another waits in NCCL would hang both.
    ok = torch.tensor([int(custom is not None)], dtype=torch.int32)  # a CPU tensor: through gloo
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        if custom is not None:
            print(f"rank {tp.rank}: another rank cannot use the NVLink all-reduce; using NCCL", file=sys.stderr)
        return tp
    return replace(tp, custom=custom)


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
