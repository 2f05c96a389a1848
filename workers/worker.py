"""One tensor-parallel rank as the executor drives it: a plain class, run in-process by the
uniprocess executor or as a Ray actor (one per placement-group bundle) by the Ray executor.

Life cycle, in this order: `init()` (the device, torch.distributed), `load()` (the model shard,
its KV cache plan and the persistent batch), `determine_num_blocks()` (a collective: every rank
calls it at the same time), `allocate_kv_cache()` (and the decode CUDA graphs, also a
collective), then `execute()` once per step, and `shutdown()`. The device ("auto") and the model
(a hub id) are resolved here, where the rank runs.

`execute(step)` launches the step and, for an overlapped step (`defer_output`), returns the
output of the step launched before it: the device runs step N while the host sends its result
back and the scheduler prepares step N+1.
"""
from __future__ import annotations

import dataclasses
import os
import socket
from typing import Any

import torch

from distengine.config import EngineConfig
from distengine.step import StepOutput, StepPlan


# Tensors up to this size take the NVLink one-shot all-reduce (a decode step's, up to a few hundred
# sequences); larger ones (prefills) NCCL.
CUSTOM_ALL_REDUCE_MAX_BYTES = 1 << 20


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Worker:
    def __init__(self, rank: int, world_size: int, config: EngineConfig, init_method: str | None = None) -> None:
        self.rank, self.world_size, self.config, self.init_method = rank, world_size, config, init_method
        self.device: torch.device | None = None
        self.device_index: int | None = None  # set by the Ray executor: this rank's GPU among the visible ones
        self.tp = None
        self.runner = None
        self._pending = None  # the launched step whose output the next execute() returns

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

    def gpu_placement(self) -> tuple[str, list[str]]:
        """(this actor's Ray node, the GPU ids Ray assigned it)."""
        import ray
        return ray.get_runtime_context().get_node_id(), [str(g) for g in ray.get_gpu_ids()]

    def set_visible_gpus(self, visible: list[str], index: int) -> None:
        """See every GPU the engine holds on this node, and use the `index`-th: peer-to-peer
        all-reduces (symmetric memory) need distinct device numbers on the ranks of a node, which
        Ray's one-GPU-per-actor CUDA_VISIBLE_DEVICES hides. Before CUDA is first used."""
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible)
        self.device_index = index

    def init(self, init_method: str | None = None) -> None:
        """Pick the device and join the tensor-parallel group: gloo on CPU, NCCL on GPUs. Under
        Ray the actor sees only its own GPU (CUDA_VISIBLE_DEVICES), so it is cuda:0.
        NCCL_NVLS_ENABLE is taken from the environment as it is (the Ray executor sets it)."""
        from workers.model_runner import resolve_device
        from workers.parallel import init_tp_group
        if init_method is not None:
            self.init_method = init_method
        self.device = resolve_device(self.config.device)
        if self.device.type == "cuda":
            if self.device_index is not None:
                self.device = torch.device("cuda", self.device_index)
            elif self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        torch.manual_seed(self.config.seed)
        if self.world_size > 1 and self.init_method is None:
            raise ValueError(f"rank {self.rank} of {self.world_size}: no init_method (tcp://HOST:PORT) to join")
        # On GPUs NCCL carries the model's collectives; CPU tensors go through gloo in the same group.
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        self.tp = init_tp_group(self.rank, self.world_size, self.init_method or "", backend)

    def load(self) -> None:
        from workers.model_runner import ModelRunner
        from workers.parallel import TPGroup
        tp = self.tp or TPGroup()
        if tp.world_size > 1 and self.device.type == "cuda" and not self.config.disable_custom_all_reduce:
            tp = dataclasses.replace(tp, custom=self._custom_all_reduce())
        self.tp = tp
        self.runner = ModelRunner(self.config, tp, self.device)

    def _custom_all_reduce(self):
        """The NVLink all-reduce for decode-sized tensors, or None (NCCL only) where the GPUs
        cannot do it."""
        import sys

        from workers.loader import load_hf_config, resolve_dtype, resolve_model_path
        from workers.parallel import NVLinkAllReduce
        dtype = resolve_dtype(load_hf_config(resolve_model_path(self.config.model)), self.config.dtype, self.device)
        import torch.distributed as dist
        custom = None
        try:
            custom = NVLinkAllReduce(self.device, dtype, CUSTOM_ALL_REDUCE_MAX_BYTES)
        except Exception as e:  # noqa: BLE001 - no P2P, no symmetric memory: NCCL does it all
            print(f"rank {self.rank}: the NVLink all-reduce is unavailable ({type(e).__name__}: {e}); using NCCL",
                  file=sys.stderr)
        # Every rank or none: one rank in the NVLink kernel while another waits in NCCL would hang both.
        ok = torch.tensor([int(custom is not None)], dtype=torch.int32)  # a CPU tensor: through gloo
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item() and custom is not None:
            print(f"rank {self.rank}: another rank cannot use the NVLink all-reduce; using NCCL", file=sys.stderr)
        return custom if ok.item() else None

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def plan_info(self) -> dict[str, Any]:
        """Plain data about the plan the scheduler's block manager must follow."""
        plan, r = self.runner.plan, self.runner
        return {"block_size": plan.block_size, "num_groups": len(plan.groups),
                "group_kinds": [g.spec.kind for g in plan.groups], "max_model_len": plan.max_model_len,
                "vocab_size": int(r.vocab_size), "block_bytes": plan.block_bytes, "num_buffers": plan.num_slots,
                "tp_size": plan.tp_size, "dtype": str(r.dtype).removeprefix("torch."), "num_blocks": r.num_blocks,
                "device": str(self.device), "cuda_graphs": r.graphs.sizes if r.graphs else [],
                "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU",
                "graph_memory_bytes": r.graph_memory_bytes, "max_num_batched_tokens": r.max_num_batched_tokens,
                "weight_bytes": sum(p.numel() * p.element_size() for p in r.model.parameters()),
                "experts": expert_layers(r.model)}

    def measure_ceilings(self) -> tuple[float, float]:
        """(copy bandwidth in bytes/s, matrix-product rate in FLOP/s) of this rank's device: the
        benchmarks' roofline, measured where the engine runs."""
        from launch.bench_common import copy_bandwidth, matmul_rate
        return copy_bandwidth(str(self.device)), matmul_rate(str(self.device))

    def get_plan(self):
        """The KVCachePlan itself (a picklable dataclass): what `KVCacheManager(plan, num_blocks)`
        on the scheduler's side takes."""
        return self.runner.plan

    # ---- the step --------------------------------------------------------------------------
    def execute(self, step: bytes | StepPlan) -> StepOutput | None:
        """Launch `step`; return its output, or for an overlapped step the previous one's. Only
        rank 0 returns outputs. An error names this rank (the executor reports which one failed)."""
        try:
            if self.device_index is not None:
                # Ray's compiled graph calls this from its own thread, whose current device is 0.
                torch.cuda.set_device(self.device)
            plan = StepPlan.decode(step) if isinstance(step, bytes) else step
            pending = self.runner.execute(plan)
            if not plan.defer_output:
                return pending.get() if pending is not None else None
            previous, self._pending = self._pending, pending
            return previous.get() if previous is not None else None
        except Exception as e:
            raise RuntimeError(f"rank {self.rank}: {type(e).__name__}: {e}") from e

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        import gc

        import torch.distributed as dist
        self._pending = None
        self.runner = None
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        # An in-process worker outlives its engine: give the weights and the KV cache back now.
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def expert_layers(model: torch.nn.Module) -> list[tuple[int, int, int]]:
    """(experts, experts per token, this rank's bytes of their weights) per routed-experts layer:
    a decode step reads only the experts its tokens chose (the benchmarks' roofline)."""
    from workers.layers.moe import FusedMoE
    return [(m.num_experts, m.top_k, sum(p.numel() * p.element_size() for p in m.parameters()))
            for m in model.modules() if isinstance(m, FusedMoE)]
