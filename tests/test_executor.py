"""The executors on CPU: two Ray actors joined by gloo, driven through the compiled Ray graph,
give the same greedy tokens as one worker in-process, with and without overlapped steps; a killed
worker makes the engine dead within seconds (no hang); a placement group the cluster cannot hold
fails quickly with a clear error; shutdown ends the actors and frees the placement group.

One Ray cluster (4 logical CPUs) serves the module: starting Ray and the actors is the slow part.
"""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from distengine.config import EngineConfig
from distengine.engine_core import EngineCore
from distengine.executor import EngineDeadError, PlacementGroupError, RayExecutor, UniprocExecutor
from distengine.sampling_params import SamplingParams
from distengine.scheduler import EngineRequest
from distengine.step import NewRequest, RequestSampling, ScheduledRequest, StepPlan
from tests.test_models import build

ray = pytest.importorskip("ray")

ARGS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, kv_cache_memory_bytes=int(0.002 * (1 << 30)))


def config(folder: str, **kw) -> EngineConfig:
    return EngineConfig.create(folder, **{**ARGS, **kw})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf, _ = build("llama")
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder)
    return hf, str(folder)


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    assert ray.cluster_resources().get("CPU") == 4  # (the counts below)


@pytest.fixture(scope="module")
def tp2(cluster, checkpoint):
    ex = RayExecutor(config(checkpoint[1], tensor_parallel_size=2))
    yield ex
    ex.shutdown()


def _greedy(executor, prompts, overlap: bool, steps=12):
    """The engine loop over `executor`: request 0 alone first, request 1's prefill joins its
    decodes a few steps later."""
    core = EngineCore(dataclasses.replace(executor.config, async_scheduling=overlap), executor)
    assert core.info.num_blocks == int(0.002 * (1 << 30)) // core.plan.block_bytes
    reqs = [EngineRequest(f"r{i}", p, sampling=SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
            for i, p in enumerate(prompts)]
    core.add_request(reqs[0])
    for n in range(200):
        if n == 3:
            core.add_request(reqs[1])
        if n > 3 and not core.has_unfinished() and not core.scheduler.has_in_flight():
            break
        core.step()
    core.step()  # the finished ids reach the workers
    return [r.output_token_ids for r in reqs]


def test_engine_info(tp2, checkpoint):
    """The engine decides the plan and the blocks on the driver, from what the ranks report."""
    info = EngineCore(config(checkpoint[1], tensor_parallel_size=2), tp2).info
    plan = info.plan
    assert plan.block_size == 4 and plan.max_model_len == 128 and info.vocab_size == 300 and plan.tp_size == 2
    assert {g.spec.kind for g in plan.groups} == {"full_attention"}
    assert info.num_blocks == int(0.002 * (1 << 30)) // plan.block_bytes
    assert [d.rank for d in info.devices] == [0, 1] and all(d.device == "cpu" for d in info.devices)
    assert len(info.memory) == 2 and info.memory[0].weight_bytes == info.memory[1].weight_bytes > 0
    assert info.config.device == "cpu" and info.config.dtype == "float32" and info.config.max_num_batched_tokens > 0
    tp2.check_health()


def test_tp2_greedy_equals_uniproc_and_transformers(tp2, checkpoint):
    hf, folder = checkpoint
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (21, 30)]
    got = {overlap: _greedy(tp2, prompts, overlap) for overlap in (False, True)}
    with UniprocExecutor(config(folder)) as one:
        want = _greedy(one, prompts, True)
    assert got[False] == got[True] == want
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=len(want[0]), do_sample=False,
                          attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long))[0, len(prompts[0]):]
    assert want[0] == ref.tolist()


def test_worker_error_makes_engine_dead(checkpoint):
    """A step a worker refuses: the error comes back (no hang) and the engine is dead after."""
    ex = UniprocExecutor(config(checkpoint[1]))
    EngineCore(ex.config, ex)
    with pytest.raises(EngineDeadError, match="never sent"):
        ex.execute(StepPlan(0, scheduled=[ScheduledRequest("x", 0, 1, [1], [], True)]))
    with pytest.raises(EngineDeadError):
        ex.execute(StepPlan(1))
    ex.shutdown()


def test_unsatisfiable_placement_group_fails_quickly(tp2, checkpoint):
    t = time.monotonic()
    with pytest.raises(PlacementGroupError, match=r"asked for 8 CPUs .* has 4 CPUs in total"):
        RayExecutor(config(checkpoint[1], tensor_parallel_size=8), placement_timeout_s=1.5)
    with pytest.raises(PlacementGroupError, match=r"asked for 2 GPUs .* has 0 GPUs in total"):
        RayExecutor(config(checkpoint[1], tensor_parallel_size=2, device="cuda"), placement_timeout_s=1.5)
    assert time.monotonic() - t < 20
    assert ray.is_initialized()  # it joined the cluster: not its own to stop
    assert all(p["state"] in ("REMOVED", "CREATED") for p in ray.util.placement_group_table().values())
    assert sum(1 for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED") == 1  # tp2's
    tp2.check_health()


def test_killed_worker_makes_engine_dead_and_shutdown_frees_all(tp2, checkpoint):
    ex = RayExecutor(config(checkpoint[1], tensor_parallel_size=2))
    EngineCore(ex.config, ex)
    assert ray.available_resources().get("CPU", 0) == 0  # 2 + 2 of 4
    step = StepPlan(0, [NewRequest("a", [[1, 2, 3]], RequestSampling())],
                    [ScheduledRequest("a", 0, 10, list(range(1, 11)), [], True)])
    assert len(ex.execute(step).token_ids) == 1
    actors, pg = list(ex.actors), ex.pg
    ray.kill(actors[1])
    t = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        ex.execute(StepPlan(1, scheduled=[ScheduledRequest("a", 10, 1, [], [], True)]))
    assert time.monotonic() - t < 5
    t = time.monotonic()
    with pytest.raises(EngineDeadError):  # at once, every later call
        ex.execute(StepPlan(2))
    with pytest.raises(EngineDeadError):
        ex.check_health()
    assert time.monotonic() - t < 1
    ex.shutdown()
    ex.shutdown()  # idempotent
    for a in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(a.ping.remote(), timeout=30)
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU", 0) == 2  # the fixture's two workers hold the rest
    assert ray.is_initialized()
    tp2.check_health()  # the other engine is untouched


@pytest.mark.parametrize("name", ["llama", "gemma4", "qwen3_5_moe"])
def test_in_process_shutdown_gives_the_model_and_cache_back(tmp_path, name):
    """The worker outlives its engine in this process: its shutdown frees the weights and the
    pool (a collection only where a reference cycle would keep them)."""
    import weakref
    hf, _ = build(name)
    hf.save_pretrained(tmp_path)
    ex = UniprocExecutor(config(str(tmp_path)))
    EngineCore(ex.config, ex)
    runner = ex.worker.runner
    held = [weakref.ref(runner.model), weakref.ref(runner.kv_pool)]
    del runner
    ex.shutdown()
    assert [ref() is None for ref in held] == [True, True]
