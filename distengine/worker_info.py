"""What a worker reports to the engine: only what only it can see, where it runs. The engine
decides everything else (the token budget, the KV cache plan, how many blocks each rank holds)
from these reports and its own config, once, on the driver."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    """A worker's device, reported when it joins the tensor-parallel group."""
    rank: int
    device: str        # as torch names it: "cuda:0", "cpu"
    name: str          # "NVIDIA H200", "CPU"
    total_memory: int  # bytes; 0 on a CPU

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True)
class MemoryProfile:
    """A worker's memory after loading its shard and a profiling pass at the largest step (and
    a capture of the decode CUDA graphs): what the KV cache may take follows from it. All bytes;
    on a CPU only `weight_bytes` is measured."""
    weight_bytes: int         # this rank's shard of the weights
    peak_bytes: int = 0       # the allocator's peak during the profiling pass, weights included
    reserved_bytes: int = 0   # held by the allocator after it
    free_bytes: int = 0       # free on the device, as the driver counts it
    total_bytes: int = 0
    graph_bytes: int = 0      # the decode CUDA graphs' own memory

    @property
    def outside_torch_bytes(self) -> int:
        """Memory in use that PyTorch's allocator does not hold (the CUDA context, NCCL, others)."""
        return self.total_bytes - self.free_bytes - self.reserved_bytes

    def usable_bytes(self, utilization: float) -> float:
        """The KV cache's share of `utilization` of the device, after the profiling peak, what
        others use and the graphs."""
        return self.total_bytes * utilization - self.peak_bytes - self.outside_torch_bytes - self.graph_bytes

    @property
    def room_bytes(self) -> int:
        """The most the KV cache can take at all."""
        return self.free_bytes + self.reserved_bytes - self.peak_bytes - self.graph_bytes
