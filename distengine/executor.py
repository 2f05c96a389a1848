"""Executors: where the tensor-parallel workers run, and how one step reaches all of them.

`UniprocExecutor` runs one `workers.worker.Worker` in this process (TP=1, no Ray).
`RayExecutor` runs one Worker actor per rank on a Ray cluster:

* Ray: joins the cluster that is already initialised in this process, else `ray_address` or the
  environment's `RAY_ADDRESS`, else starts a local one (on CPU with `num_cpus=max(tp, 2)`), which
  it then also shuts down.
* A placement group of one bundle per rank (`{"GPU": 1}`, or `{"CPU": 1}` on CPU), strategy PACK
  (all ranks on as few nodes as possible) or SPREAD. When the cluster cannot hold it, a clear error
  names what was asked for and what the cluster has: at once on a local cluster started here, after
  `placement_timeout_s` when joining one (an autoscaler may add nodes meanwhile).
* One actor per bundle; `torch.distributed` (NCCL on GPUs, gloo on CPU) rendezvouses at the IP of
  rank 0's node and a free port picked there. Actors get `NCCL_NVLS_ENABLE` (default "0") and a
  `PYTHONPATH` holding this project.
* Each step is packed once with msgpack and the same bytes reach every rank through one compiled
  Ray graph (`ray.dag`, compiled once: shared-memory channels to the actors, no actor call per rank
  per step); only rank 0's output (the sampled tokens, with request ids) comes back. A rank that
  raises or dies (noticed at once), or a step slower than `execute_timeout_s`, marks the executor
  dead: `EngineDeadError` now and on every later call.

Multi-host cluster (every host needs the project installed, or at the same path as on the driver,
and the model reachable: a Hugging Face id or the same folder on every host):

    # on the head node
    ray start --head --port=6379 --num-gpus=N
    # on every other node
    ray start --address=HEAD_IP:6379 --num-gpus=N
    # then, on the head (or any node), run the engine with
    RAY_ADDRESS=HEAD_IP:6379 python my_script.py      # or LLM(..., ray_address="HEAD_IP:6379")

Use `placement_strategy="SPREAD"` to place the ranks on different nodes. `ray stop` on every node
ends the cluster. CPU-only (for tests): `--num-cpus 1` instead of `--num-gpus`, and device="cpu".
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import distengine
from distengine.config import EngineConfig
from distengine.config_snapshot import ConfigSnapshot
from distengine.kv_cache.plan import KVCachePlan
from distengine.step import StepOutput, StepPlan
from distengine.worker_info import DeviceInfo, MemoryProfile

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(distengine.__file__)))


NODE_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                      "health_check_failure_threshold": 3}


class EngineDeadError(RuntimeError):
    """A worker raised or died (or a step timed out): the engine cannot go on. The original error
    is `__cause__` (and `.cause`)."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class RequestError(RuntimeError):
    """One request failed on the driver (a step could not carry it, its output could not be
    decoded, ...); the engine and every other request go on."""


class PlacementGroupError(RuntimeError):
    """The cluster cannot hold one bundle per tensor-parallel rank."""


class Executor:
    """Where the workers run, as the engine core sees it: `config` (placed: the device and dtype
    resolved for where the workers run, `gpus_available`) and `devices` (what each rank reported
    of its device) once built; then `load(config, plan, hf_config) -> [MemoryProfile]` per rank,
    `allocate_kv_cache(num_blocks)`, and `execute(step) -> rank 0's StepOutput` (the previous
    step's, for an overlapped step),
    `collective_rpc`, `check_health()`, `shutdown()`."""

    config: EngineConfig
    devices: list[DeviceInfo]
    gpus_available: bool  # where the workers run: what "auto" resolves to
    is_dead: bool = False
    _dead_cause: BaseException | None = None
    _dead_message: str = ""

    def load(self, config: EngineConfig, plan: KVCachePlan, hf_config: ConfigSnapshot) -> list[MemoryProfile]:
        """Every rank loads its shard for the engine's resolved config and plan (the model's
        config as the driver parsed it), then profiles its memory (a collective); their profiles
        in rank order."""
        raise NotImplementedError

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Every rank allocates `num_blocks` and captures its CUDA graphs; then steps may run."""
        raise NotImplementedError

    def execute(self, step: StepPlan) -> StepOutput | None:
        raise NotImplementedError

    def check_health(self, timeout: float | None = None) -> None:
        """EngineDeadError unless every rank answers (within `timeout` seconds, default the
        executor's own); a rank that does not makes the engine dead."""
        raise NotImplementedError

    def collective_rpc(self, method: str | Callable, args: tuple = (), ranks: list[int] | None = None) -> list:
        """`Worker.method(*args)`, or `method(worker, *args)` for a function (a benchmark's
        measurement: the worker does not import it), on the given ranks (default: all), their
        results in rank order (vLLM's name). Not for the step: that is `execute`."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def _raise_if_dead(self) -> None:
        if self.is_dead:
            raise EngineDeadError(f"the engine is dead: {self._dead_message}", self._dead_cause) from self._dead_cause

    def _die(self, message: str, cause: BaseException | None) -> EngineDeadError:
        self.is_dead, self._dead_message, self._dead_cause = True, message, cause
        err = EngineDeadError(message, cause)
        err.__cause__ = cause
        return err

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class UniprocExecutor(Executor):
    """One Worker in this process: TP=1, no Ray. The step goes to it as the typed plan itself."""

    def __init__(self, config: EngineConfig) -> None:
        import torch

        from workers.worker import Worker
        if config.tensor_parallel_size != 1:
            raise ValueError(f"UniprocExecutor runs tensor_parallel_size=1 only (got {config.tensor_parallel_size}); "
                             "use RayExecutor")
        self.gpus_available = torch.cuda.is_available()
        self.config = config.placed(self.gpus_available)
        self.worker = Worker(0, 1, self.config)
        self._closed = False
        self.devices = [self.worker.init()]

    def load(self, config: EngineConfig, plan: KVCachePlan, hf_config: ConfigSnapshot) -> list[MemoryProfile]:
        self.config = config
        self.worker.load(config, plan, hf_config)
        return [self.worker.profile_memory()]

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.worker.allocate_kv_cache(num_blocks)

    def execute(self, step: StepPlan) -> StepOutput | None:
        self._raise_if_dead()
        if self._closed:
            raise EngineDeadError("the executor was shut down")
        try:
            return self.worker.execute(step)
        except KeyboardInterrupt:  # a second Ctrl-C inside a step: the batch may be half updated
            self._die("a step was interrupted (Ctrl-C twice)", None)
            raise
        except Exception as e:  # the runner's state may be half updated: nothing can follow
            raise self._die(f"the worker raised {_short(e)}", e) from e

    def check_health(self, timeout: float | None = None) -> None:
        self._raise_if_dead()

    def collective_rpc(self, method: str | Callable, args: tuple = (), ranks: list[int] | None = None) -> list:
        self._raise_if_dead()
        return [self.worker.call(method, *args) for _ in (ranks or [0])]

    def shutdown(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.worker.shutdown()
        self.worker = None


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, placement_timeout_s: float = 60.0, startup_timeout_s: float = 900.0,
                 execute_timeout_s: float = 600.0, health_timeout_s: float = 30.0) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from workers.worker import Worker

        self.tp = config.tensor_parallel_size
        self.startup_timeout_s = startup_timeout_s
        self.execute_timeout_s, self.health_timeout_s = execute_timeout_s, health_timeout_s
        self.actors: list = []
        self.pg = None  # our own placement group (None inside the caller's)
        self._outer_pg = None
        self.dag = None
        self._owns_ray = False
        self._closed = False
        self._remove_pg = remove_placement_group

        address = config.ray_address or os.environ.get("RAY_ADDRESS") or None
        # Ray's own start-up and teardown messages (INFO, and a WARNING that token authentication
        # is on) only with DISTENGINE_VERBOSE=1 (`distengine --verbose`); errors always show.
        level = logging.INFO if os.environ.get("DISTENGINE_VERBOSE") else logging.ERROR
        logging.getLogger("ray").setLevel(level)
        if not ray.is_initialized():
            if address:
                ray.init(address=address, log_to_driver=True, logging_level=level)
            else:
                # A node whose raylet died is declared dead after 3 missed 1-s health checks (Ray's
                # default: 5 of 3 s): its workers' engine ends within seconds, not a quarter minute.
                kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": level,
                                          "_system_config": NODE_HEALTH_CHECKS}
                import torch
                if config.device_for(gpus_available=torch.cuda.is_available()) == "cpu":
                    kwargs.update(num_cpus=max(self.tp, 2), num_gpus=0)
                ray.init(**kwargs)
                self._owns_ray = True
        try:
            # Where the workers run decides "auto": the cluster's GPUs, not the driver's.
            self.gpus_available = ray.cluster_resources().get("GPU", 0) >= 1
            self.config = config = config.placed(self.gpus_available)
            kind = "GPU" if config.device.startswith("cuda") else "CPU"
            self._kind = kind

            # ---- the placement group: the caller's, or our own ----
            bundles = self._bundles_of_current_group(kind)
            if bundles is None:
                have = ray.cluster_resources().get(kind, 0)
                if self._owns_ray and have < self.tp:  # a local cluster cannot grow: say so at once
                    raise PlacementGroupError(self._pg_message(kind, have, None))
                self.pg = placement_group([{kind: 1}] * self.tp, strategy=config.placement_strategy)
                ready, _ = ray.wait([self.pg.ready()], timeout=placement_timeout_s)
                if not ready:
                    raise PlacementGroupError(self._pg_message(kind, ray.cluster_resources().get(kind, 0),
                                                               placement_timeout_s, config.placement_strategy))
                bundles = list(range(self.tp))

            # ---- the actors ----
            env = {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
                   "TORCH_SYMM_MEM_DISABLE_MULTICAST": os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                   "PYTHONPATH": os.pathsep.join(p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH")) if p)}
            for var in ("TRITON_INTERPRET", "NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "HF_HOME",
                        "HF_HUB_OFFLINE", "NVSHMEM_DISABLE_NVLS", "CUDA_LAUNCH_BLOCKING", "DISTENGINE_PDL"):
                if var in os.environ:
                    env[var] = os.environ[var]
            resources = {"num_gpus": 1, "num_cpus": 0} if kind == "GPU" else {"num_cpus": 1}
            remote_cls = ray.remote(**resources)(Worker)
            for rank in range(self.tp):
                strategy = PlacementGroupSchedulingStrategy(self.pg or self._outer_pg,
                                                            placement_group_bundle_index=bundles[rank],
                                                            placement_group_capture_child_tasks=True)
                self.actors.append(remote_cls.options(scheduling_strategy=strategy, runtime_env={"env_vars": env},
                                                      name=None).remote(rank, self.tp, config))
            self._ranks = {a._actor_id.hex(): r for r, a in enumerate(self.actors)}
            t = self.startup_timeout_s
            if kind == "GPU" and not config.disable_custom_all_reduce:
                self._share_node_gpus(t)

            # ---- torch.distributed ----
            ip, port = self._gather([self.actors[0].node_address.remote()], t, "starting")[0]
            self.init_method = f"tcp://{_bracket(ip)}:{port}"
            self.devices = self._gather([a.init.remote(self.init_method) for a in self.actors], t,
                                        "joining torch.distributed")
        except BaseException as e:
            self._fail_start(e)

    def load(self, config: EngineConfig, plan: KVCachePlan, hf_config: ConfigSnapshot) -> list[MemoryProfile]:
        self.config = config
        t = self.startup_timeout_s
        try:
            self._gather([a.load.remote(config, plan, hf_config) for a in self.actors], t, "loading the model")
            return self._gather([a.profile_memory.remote() for a in self.actors], t, "profiling its memory")
        except BaseException as e:
            self._fail_start(e)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        try:
            self._gather([a.allocate_kv_cache.remote(num_blocks) for a in self.actors], self.startup_timeout_s,
                         "allocating the KV cache")
            if self.dag is None:  # the actors' step loops outlive a reload of their models
                self.dag = self._compile()
        except BaseException as e:
            self._fail_start(e)

    def _fail_start(self, e: BaseException):
        """Nothing half-started stays behind; a rank's own refusal (a ValueError about the
        model, ...) is raised as itself."""
        self.shutdown()
        if isinstance(e, WorkerError) and e.user_error is not None:
            raise e.user_error from e
        raise e

    def _bundles_of_current_group(self, kind: str) -> list[int] | None:
        """Inside a placement group (a task of `distengine bench sweep`, or anyone's), the ranks go
        on its last `tensor_parallel_size` bundles that hold the device (the first may hold the
        caller itself); the group is the caller's, and stays when the engine shuts down."""
        from ray.util import get_current_placement_group
        outer = get_current_placement_group()
        if outer is None:
            return None
        fit = [i for i, b in enumerate(outer.bundle_specs) if b.get(kind, 0) >= 1]
        if len(fit) < self.tp:
            raise PlacementGroupError(f"this task's placement group has {len(fit)} bundle(s) with a {kind} but "
                                      f"tensor_parallel_size is {self.tp}")
        self._outer_pg = outer
        return fit[-self.tp:]

    def _share_node_gpus(self, timeout: float) -> None:
        """Every rank on a node sees all the GPUs the engine holds there (as vLLM's Ray workers
        do) and picks its own by position."""
        placements = self._gather([a.gpu_placement.remote() for a in self.actors], timeout, "starting")
        by_node: dict[str, list[str]] = {}
        for node, ids in placements:
            by_node.setdefault(node, []).extend(ids)
        for node in by_node:
            by_node[node] = sorted(set(by_node[node]), key=lambda g: (len(g), g))
        self._gather([a.set_visible_gpus.remote(by_node[node], by_node[node].index(ids[0]))
                      for a, (node, ids) in zip(self.actors, placements)], timeout, "starting")

    def _compile(self):
        """Every step reaches every rank through one compiled Ray graph: shared-memory channels
        to the actors, set up once, instead of an actor call per rank per step."""
        from ray.dag import InputNode, MultiOutputNode
        with InputNode() as step:
            dag = MultiOutputNode([a.execute.bind(step) for a in self.actors])
        return dag.experimental_compile()

    # ---- helpers --------------------------------------------------------------------------
    def _pg_message(self, kind: str, have: float, timeout: float | None, strategy: str = "PACK") -> str:
        import ray
        avail = ray.available_resources().get(kind, 0)
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        unit = "GPUs" if kind == "GPU" else "CPUs"
        waited = f" within {timeout:g} s" if timeout is not None else ""
        hint = ("start more nodes (see distengine.executor's docstring), lower tensor_parallel_size"
                if kind == "GPU" else "lower tensor_parallel_size")
        extra = f"; strategy {strategy} over {nodes} alive node(s)" if strategy != "PACK" else ""
        return (f"cannot place {self.tp} tensor-parallel workers: asked for {self.tp} {unit} "
                f"(one bundle {{'{kind}': 1}} per rank) but the Ray cluster has {have:g} {unit} in total "
                f"({avail:g} available now){extra}; the placement group was not satisfied{waited}. "
                f"Free the cluster's {unit}, {hint}.")

    def _gather(self, refs: list, timeout: float, what: str) -> list:
        """ray.get of every ref, failing on the first error as soon as it arrives (a rank that
        raised leaves the others blocked in a collective: waiting for them would hang)."""
        import ray
        index = {r: i for i, r in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, left)) if left > 0 else ([], pending)
            if not ready:
                raise WorkerError(f"timed out after {timeout:g} s {what}: rank(s) "
                                    f"{sorted(index[r] for r in pending)} did not answer")
            for r in ready:
                try:
                    results[index[r]] = ray.get(r)
                except Exception as e:  # noqa: BLE001 - RayTaskError, RayActorError...
                    user = getattr(e, "cause", None) if isinstance(e, ray.exceptions.RayTaskError) else None
                    if not isinstance(user, Exception) or isinstance(user, ray.exceptions.RayError):
                        user = None
                    err = WorkerError(f"worker rank {index[r]} failed while {what}: {_short(e)}", user)
                    err.__cause__ = e
                    raise err from e
        return results

    # ---- the step -------------------------------------------------------------------------
    def execute(self, step: StepPlan) -> StepOutput | None:
        """The same msgpack bytes to every rank; rank 0's output comes back. Any rank that
        raises or dies, or a step slower than `execute_timeout_s`, makes the engine dead."""
        import ray
        self._raise_if_dead()
        if self._closed:
            raise EngineDeadError("the executor was shut down")
        data = step.encode()  # a step that cannot be encoded reached no worker: the engine lives on
        try:
            return ray.get(self.dag.execute(data), timeout=self.execute_timeout_s)[0]
        except KeyboardInterrupt:  # a second Ctrl-C inside a step: its result is lost to the graph
            self._die("a step was interrupted (Ctrl-C twice)", None)
            raise
        except Exception as e:  # noqa: BLE001 - RayTaskError, ActorDiedError, RayChannelError...
            raise self._die(self._describe(e), e) from e

    def _describe(self, e: BaseException) -> str:
        import ray
        if isinstance(e, ray.exceptions.RayChannelTimeoutError):
            return f"a step took longer than {self.execute_timeout_s:g} s: a worker hangs"
        if isinstance(e, ray.exceptions.RayTaskError):
            return f"worker {_short(e)}"  # the worker's message starts with its rank
        # An actor that died shows as its own error, or as the graph's channels closing (Ray's
        # monitor may tear the graph down first): ask every rank which.
        dead = self._dead_ranks()
        who = f"worker rank {', '.join(map(str, dead))}" if dead else "a worker"
        return f"{who} died while executing a step: {_short(e)}"

    def _dead_ranks(self, timeout: float = 2.0) -> list[int]:
        import ray
        refs = {a.ping.remote(): r for r, a in enumerate(self.actors)}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout)
        dead = []
        for ref in ready:
            try:
                ray.get(ref)
            except Exception:  # noqa: BLE001 - RayActorError: this rank is gone
                dead.append(refs[ref])
        return sorted(dead)

    def collective_rpc(self, method: str | Callable, args: tuple = (), ranks: list[int] | None = None) -> list:
        self._raise_if_dead()
        picked = [self.actors[r] for r in (ranks if ranks is not None else range(self.tp))]
        name = method if isinstance(method, str) else getattr(method, "__name__", repr(method))
        return self._gather([a.call.remote(method, *args) for a in picked], self.execute_timeout_s, f"running {name}")

    def check_health(self, timeout: float | None = None) -> None:
        """Every rank answers a ping (served beside the compiled graph's step loop)."""
        self._raise_if_dead()
        if self._closed:
            raise EngineDeadError("the executor was shut down")
        try:
            self._gather([a.ping.remote() for a in self.actors], timeout or self.health_timeout_s, "answering a ping")
        except WorkerError as e:
            raise self._die(str(e), e.__cause__ or e) from (e.__cause__ or e)

    def shutdown(self) -> None:
        """Ends every actor, frees the placement group, and stops Ray if this executor started
        it. Idempotent; works on a dead executor (nothing waits for a rank that hangs)."""
        if self._closed:
            return
        self._closed = True
        import ray
        if not ray.is_initialized():
            return
        if self.dag is not None and not self.is_dead:
            try:
                self.dag.teardown()  # ends the actors' step loops
            except Exception:  # noqa: BLE001
                pass
        if self.actors and not self.is_dead:  # a clean goodbye to torch.distributed first
            try:
                refs = [a.shutdown.remote() for a in self.actors]
                ray.wait(refs, num_returns=len(refs), timeout=5.0)
            except Exception:  # noqa: BLE001
                pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001
                pass
        self.actors = []
        self.dag = None
        if self.pg is not None:
            try:
                self._remove_pg(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self.pg = None
        if self._owns_ray:
            ray.shutdown()

    def __del__(self) -> None:  # best effort; call shutdown() explicitly
        try:
            if not getattr(self, "_closed", True):
                self.shutdown()
        except Exception:  # noqa: BLE001
            pass


def create_executor(config: EngineConfig) -> Executor:
    """RayExecutor when TP > 1, a Ray address is given (or RAY_ADDRESS is set) or Ray is asked for;
    else in-process."""
    if config.use_ray or (os.environ.get("RAY_ADDRESS") and config.distributed_executor_backend != "uni"):
        return RayExecutor(config)
    return UniprocExecutor(config)


class WorkerError(RuntimeError):
    """A rank failed or timed out while the engine was starting (when the rank raised an ordinary
    exception, e.g. KVCacheTooSmallError or a ValueError about the model, that one is raised
    instead, with this as its cause)."""

    def __init__(self, message: str, user_error: BaseException | None = None) -> None:
        super().__init__(message)
        self.user_error = user_error


def _short(e: BaseException) -> str:
    """The last line of a remote traceback is the error itself."""
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1:
        return f"{type(e).__name__}: {lines[-1].strip()}"
    return f"{type(e).__name__}: {text}"


def _bracket(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
