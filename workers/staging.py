"""One step's host inputs in one pinned buffer, sent to the device with ONE copy.

The persistent batch packs everything a step changes (tokens, positions, table appends, the new
rows' sampling state) as sections of one int32 buffer; each section starts 16-byte aligned,
because Triton specialises kernels on pointer alignment."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

ALIGN = 4  # int32 elements per 16 bytes


class Section(NamedTuple):
    """Where one staged array lies in the buffer."""
    offset: int
    length: int
    dtype: np.dtype


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Staging:
    """One step's host inputs in one int32 buffer, copied to the device in one copy.

    Sections are packed back to back, each 16-byte aligned. Two pinned host buffers alternate,
    so packing step N+1 never overwrites step N's buffer while its copy may still be queued; a
    buffer is reused only after its copy's event has completed. Buffers grow when a step needs
    more (rare: admission steps with long prefix hits).

    The device buffer's first `fixed` elements stay at one address for the staging's life
    (`fixed_region`): a CUDA graph reads its inputs there, written by the step's one copy with
    no device-to-device copy after it. A step packs its fixed section first."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16, fixed: int = 0) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.host: list[torch.Tensor] = []
        self.events: list = [None, None]
        self.k = 0
        self.used = 0
        self.dev = torch.zeros(max(capacity, round_up(fixed, ALIGN)), dtype=torch.int32, device=device)
        self.fixed_region = self.dev[:fixed]
        self._grow(self.dev.numel())

    def _grow(self, capacity: int) -> None:
        for e in self.events:
            if e is not None:
                e.synchronize()
        self.host = [torch.empty(capacity, dtype=torch.int32, pin_memory=self.cuda) for _ in range(2)]
        self.np = [h.numpy() for h in self.host]
        if capacity > self.dev.numel():
            # The fixed region's contents and address are kept: the new buffer's copy goes
            # around it (`commit`).
            self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device)
        self.events = [None, None]

    def begin(self, upper_bound: int) -> None:
        """Start packing a step that needs at most `upper_bound` int32 elements."""
        if upper_bound > self.host[0].numel():
            self._grow(round_up(upper_bound * 2, 1 << 16))
        self.k ^= 1
        if self.events[self.k] is not None:
            self.events[self.k].synchronize()  # normally long done: a step ago
        self.used = 0

    def put(self, values, dtype=np.int32) -> Section:
        """Append a section; returns where it lies."""
        arr = np.asarray(values, dtype=dtype)
        n32 = arr.size * arr.itemsize // 4
        off = self.used
        self.np[self.k][off:off + n32] = arr.reshape(-1).view(np.int32)
        self.used = off + round_up(max(n32, 1), ALIGN)
        return Section(off, arr.size, np.dtype(dtype))

    def commit(self) -> None:
        """The one host-to-device copy of the step (two once the buffer has grown: the fixed
        region keeps its address)."""
        n = self.used
        self.dev[:n].copy_(self.host[self.k][:n], non_blocking=True)
        if self.fixed_region.numel() and self.dev.data_ptr() != self.fixed_region.data_ptr():
            self.fixed_region.copy_(self.host[self.k][:self.fixed_region.numel()], non_blocking=True)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.events[self.k] = ev

    def view(self, handle: Section) -> torch.Tensor:
        off, n, dtype = handle
        if dtype == np.int32:
            return self.dev[off:off + n]
        torch_dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.int64): torch.int64}[dtype]
        words = n * dtype.itemsize // 4
        return self.dev[off:off + words].view(torch_dtype)
