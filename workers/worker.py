"""One tensor-parallel rank as the executor drives it: a plain class, run in-process by the
uniprocess executor or as a Ray actor (one per placement-group bundle) by the Ray executor.

Life cycle, in this order: `init()` (torch.distributed; on a GPU the actor's device), `load()`
(the model shard and its KV cache plan), `determine_num_blocks()` (a collective: every rank calls
it at the same time), `allocate_kv_cache()`, then `execute()` once per step with the step packed by
msgpack (the same bytes for every rank), and `shutdown()`.
"""
from __future__ import annotations

import os
import socket
from typing import Any

import msgpack
import torch


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Worker:
    def __init__(self, rank: int = 0, world_size: int = 1, init_method: str | None = None, model: str = "",
                 device: str = "cpu", dtype: str = "auto", block_size: int = 16, max_model_len: int | None = None,
                 max_num_batched_tokens: int = 2048, seed: int = 0) -> None:
        self.rank, self.world_size, self.init_method = rank, world_size, init_method
        self.model, self.dtype, self.block_size = model, dtype, block_size
        self.max_model_len, self.max_num_batched_tokens, self.seed = max_model_len, max_num_batched_tokens, seed
        self.device = torch.device(device)
        self.tp = None
        self.runner = None

    # ---- set-up ----------------------------------------------------------------------------
    def node_address(self) -> tuple[str, int]:
        """(IP of this worker's node, a free port on it): rank 0's answer is where
        torch.distributed rendezvouses."""
        try:
            import ray
            ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        except Exception:  # noqa: BLE001 - not under Ray
            ip = "127.0.0.1"
        return ip, _free_port()

    def init(self, init_method: str | None = None) -> None:
        """Join the tensor-parallel group: gloo on CPU, NCCL on GPUs. Under Ray the actor sees only
        its own GPU (CUDA_VISIBLE_DEVICES), so it is cuda:0. NCCL_NVLS_ENABLE is taken from the
        environment as it is (the Ray executor sets it for its actors)."""
        from workers.parallel import init_tp_group
        if init_method is not None:
            self.init_method = init_method
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.seed)
        if self.world_size > 1 and self.init_method is None:
            raise ValueError(f"rank {self.rank} of {self.world_size}: no init_method (tcp://HOST:PORT) to join")
        # On GPUs NCCL carries the model's collectives; CPU tensors (the runner's all-reduce of
        # the block count) go through gloo in the same group.
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        self.tp = init_tp_group(self.rank, self.world_size, self.init_method or "", backend)

    def load(self) -> None:
        from workers.model_runner import ModelRunner
        from workers.parallel import TPGroup
        self.runner = ModelRunner(self.model, self.tp or TPGroup(), self.device, self.dtype, self.block_size,
                                  self.max_model_len, self.max_num_batched_tokens)

    def determine_num_blocks(self, gpu_memory_utilization: float = 0.9, cpu_kv_cache_gib: float = 1.0) -> int:
        return self.runner.determine_num_blocks(gpu_memory_utilization, cpu_kv_cache_gib)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def plan_info(self) -> dict[str, Any]:
        """Plain data about the plan the scheduler's block manager must follow."""
        plan = self.runner.plan
        return {"block_size": plan.block_size, "num_groups": len(plan.groups),
                "group_kinds": [g.spec.kind for g in plan.groups], "max_model_len": plan.max_model_len,
                "vocab_size": int(self.runner.vocab_size), "block_bytes": plan.block_bytes,
                "num_buffers": plan.num_slots, "tp_size": plan.tp_size, "dtype": str(self.runner.dtype).removeprefix("torch."),
                "num_blocks": getattr(self.runner, "num_blocks", None)}

    def get_plan(self):
        """The KVCachePlan itself (a picklable dataclass): what `KVCacheManager(plan, num_blocks)`
        on the scheduler's side takes."""
        return self.runner.plan

    # ---- the step --------------------------------------------------------------------------
    def execute(self, packed: bytes) -> dict | None:
        step = msgpack.unpackb(packed, raw=False, strict_map_key=False)
        return self.runner.execute(step)

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        import gc

        import torch
        import torch.distributed as dist
        self.runner = None
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        # An in-process worker outlives its engine: give the weights and the KV cache back now.
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
