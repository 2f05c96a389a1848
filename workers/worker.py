"""One tensor-parallel rank as the executor drives it: a plain class, run in-process by the
uniprocess executor or as a Ray actor (one per placement-group bundle) by the Ray executor.

Life cycle, in this order: `init()` (the device, torch.distributed; reports the device),
`load(config, plan)` (the model shard and the persistent batch, for the engine's resolved config
and KV cache plan), `profile_memory()` (a collective: every rank runs a profiling pass at the same
time; reports what the KV cache can take), `allocate_kv_cache(num_blocks)` (and the decode CUDA
graphs, also a collective), then `execute()` once per step, and `shutdown()`.

`execute(step)` launches the step and, for an overlapped step (`defer_output`), returns the
output of the step launched before it: the device runs step N while the host sends its result
back and the scheduler prepares step N+1. A step whose grammar masks follow is sampled in the
next call, which returns its output.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch

from distengine.config import EngineConfig
from distengine.config_snapshot import ConfigSnapshot
from distengine.kv_cache.plan import KVCachePlan
from distengine.step import StepOutput, StepPlan
from distengine.worker_info import DeviceInfo, MemoryProfile


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
        self._threads: int | None = None  # torch's CPU threads before this worker set them

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

    def init(self, init_method: str | None = None) -> DeviceInfo:
        """Take the device and join the tensor-parallel group: gloo on CPU, NCCL on GPUs. Under
        Ray the actor sees only its own GPU (CUDA_VISIBLE_DEVICES) unless the executor shared
        the node's (`set_visible_gpus`). NCCL_NVLS_ENABLE is taken from the environment as it is
        (the Ray executor sets it)."""
        from workers.parallel import init_tp_group
        if init_method is not None:
            self.init_method = init_method
        self.device = torch.device(self.config.device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={self.config.device!r} but this process sees no CUDA GPU")
            if self.device_index is not None:
                self.device = torch.device("cuda", self.device_index)
            elif self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        if self.device.type == "cpu":
            # As Ray gives its CPU workers (OMP_NUM_THREADS=1): torch's default, a thread per core,
            # spins against whatever else runs there (the front end, a second rank) and a step on a
            # busy machine takes many times as long. Given back at shutdown.
            self._threads = torch.get_num_threads()
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
        torch.manual_seed(self.config.seed)
        if self.world_size > 1 and self.init_method is None:
            raise ValueError(f"rank {self.rank} of {self.world_size}: no init_method (tcp://HOST:PORT) to join")
        # On GPUs NCCL carries the model's collectives; CPU tensors go through gloo in the same group.
        backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
        self.tp = init_tp_group(self.rank, self.world_size, self.init_method or "", backend)
        cuda = self.device.type == "cuda"
        return DeviceInfo(self.rank, str(self.device), torch.cuda.get_device_name(self.device) if cuda else "CPU",
                          torch.cuda.get_device_properties(self.device).total_memory if cuda else 0)

    def load(self, config: EngineConfig, plan: KVCachePlan, hf_config: ConfigSnapshot | None = None) -> None:
        """The model shard and its persistent batch, for the engine's config (its token budget
        resolved), the KV cache plan the engine made and the model's config as the engine read
        it (None: read here)."""
        from distengine.hf_config import DTYPES
        from workers.model_runner import ModelRunner
        from workers.parallel import TPGroup, with_nvlink_all_reduce
        self.config = config
        tp = self.tp or TPGroup()
        if tp.world_size > 1 and self.device.type == "cuda" and not config.disable_custom_all_reduce \
                and tp.custom is None:
            tp = with_nvlink_all_reduce(tp, self.device, DTYPES[config.dtype])
        self.tp = tp
        self.runner = ModelRunner(config, plan, tp, self.device, hf_config)

    def profile_memory(self) -> MemoryProfile:
        return self.runner.profile_memory()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def call(self, method: str | Callable, *args) -> Any:
        """`self.method(*args)`, or `method(self, *args)` for a function: what the executor's
        `collective_rpc` runs here (a benchmark's measurement, a test's probe)."""
        if isinstance(method, str):
            return getattr(self, method)(*args)
        return method(self, *args)

    # ---- the step --------------------------------------------------------------------------
    def execute(self, step: bytes | StepPlan) -> StepOutput | None:
        """Launch `step`; return its output, or for an overlapped step the previous one's. Only
        rank 0 returns outputs. An error names this rank (the executor reports which one failed)."""
        try:
            if self.device_index is not None:
                # Ray's compiled graph calls this from its own thread, whose current device is 0.
                torch.cuda.set_device(self.device)
            plan = StepPlan.decode(step) if isinstance(step, bytes) else step
            if plan.masks_follow and not plan.defer_output:
                raise ValueError(f"step {plan.step_id}: masks can follow only an overlapped step (defer_output)")
            launched = self.runner.execute(plan)
            this = [p for p in launched if p.step_id == plan.step_id]
            if not plan.defer_output:
                return this[0].get() if this else None
            # The step before this one was launched in the last call, or sampled in this one (its
            # masks came with this plan).
            earlier = [p for p in launched if p.step_id != plan.step_id]
            previous = self._pending if self._pending is not None else (earlier[0] if earlier else None)
            self._pending = this[0] if this else None
            return previous.get() if previous is not None else None
        except Exception as e:
            raise RuntimeError(f"rank {self.rank}: {type(e).__name__}: {e}") from e

    def ping(self) -> int:
        return self.rank

    def pid(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        import gc
        import weakref

        import torch.distributed as dist
        held = []
        if self.runner is not None:
            held = [weakref.ref(self.runner.model)]
            if self.runner.kv_pool is not None:
                held.append(weakref.ref(self.runner.kv_pool))
        self._pending = None
        self.runner = None
        if self._threads is not None:
            torch.set_num_threads(self._threads)
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        # An in-process worker outlives its engine: give the weights and the KV cache back now.
        # A full collection (a fifth of a second in a large process) only where a reference
        # cycle still holds them.
        if any(ref() is not None for ref in held):
            gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

