"""The executors on CPU: two Ray actors joined by gloo give the same greedy tokens as one worker
in-process; a killed worker makes the engine dead at once (no hang); a placement group the
cluster cannot hold fails quickly with a clear error; shutdown ends the actors and frees the
placement group.

One Ray cluster (4 logical CPUs) serves the module: starting Ray and the actors is the slow part.
"""
from __future__ import annotations

import time

import pytest
import torch

from distengine.executor import EngineDeadError, PlacementGroupError, RayExecutor, UniprocExecutor
from distengine.kv_cache.manager import KVCacheManager
from distengine.request import Request
from tests.test_models import build

ray = pytest.importorskip("ray")

ARGS = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, cpu_kv_cache_gib=0.002)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf, _ = build("llama")
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder)
    return hf, str(folder)


@pytest.fixture(scope="module")
def cluster():
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, num_gpus=0, include_dashboard=False)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def tp2(cluster, checkpoint):
    ex = RayExecutor(checkpoint[1], tensor_parallel_size=2, **ARGS)
    yield ex
    ex.shutdown()


def _step(mgr, known, batch):
    """The scheduler's side of one step: allocate, then describe only what changed."""
    step = {"new": [], "scheduled": [], "finished": []}
    for req, n in batch:
        before = [len(t) for t in mgr.get_block_ids(req.request_id)]
        assert mgr.allocate_slots(req, n) is not None
        ids = mgr.get_block_ids(req.request_id)
        if req.request_id not in known:
            step["new"].append({"id": req.request_id, "token_ids": list(req.all_token_ids),
                                "block_ids": [list(t) for t in ids], "sampling": {"temperature": 0.0}})
            new_tokens, new_blocks = [], [[] for _ in ids]
        else:
            new_tokens = req.all_token_ids[known[req.request_id]:]
            new_blocks = [list(t[b:]) for t, b in zip(ids, before)]
        known[req.request_id] = req.num_tokens
        step["scheduled"].append({"id": req.request_id, "num_computed": req.num_computed_tokens, "num_tokens": n,
                                  "new_token_ids": new_tokens, "new_block_ids": new_blocks, "sample": True})
    return step


def _greedy(executor, prompts, steps=12):
    """Drive the executor like the scheduler: request 0 alone first, request 1's prefill joins
    its decodes at step 3."""
    mgr = KVCacheManager(executor.plan, executor.num_blocks)
    reqs = [Request(f"r{i}", p) for i, p in enumerate(prompts)]
    known: dict[str, int] = {}
    active = [(reqs[0], reqs[0].num_tokens)]
    for step_no in range(steps):
        if step_no == 3:
            active.append((reqs[1], reqs[1].num_tokens))
        result = executor.execute(_step(mgr, known, active))
        assert len(result["token_ids"]) == len(active)
        nxt = []
        for (req, n), tok in zip(active, result["token_ids"]):
            req.num_computed_tokens += n
            req.append_output_token(tok)
            nxt.append((req, 1))
        active = nxt
    executor.execute({"finished": [r.request_id for r in reqs]})
    return [r.output_token_ids for r in reqs]


def test_plan_info(tp2):
    info = tp2.plan_info
    assert info["block_size"] == 4 and info["max_model_len"] == 128 and info["vocab_size"] == 300
    assert info["num_groups"] == len(info["group_kinds"]) == len(tp2.plan.groups) >= 1
    assert set(info["group_kinds"]) == {"full_attention"} and info["tp_size"] == 2
    assert tp2.num_blocks == int(0.002 * (1 << 30)) // info["block_bytes"]
    tp2.check_health()


def test_tp2_greedy_equals_uniproc_and_transformers(tp2, checkpoint):
    hf, folder = checkpoint
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (21, 30)]
    got = _greedy(tp2, prompts)
    with UniprocExecutor(folder, **ARGS) as one:
        assert one.num_blocks == int(0.002 * (1 << 30)) // one.plan_info["block_bytes"]
        want = _greedy(one, prompts)
    assert got == want
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=len(got[0]), do_sample=False,
                          attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long))[0, len(prompts[0]):]
    assert got[0] == ref.tolist()


def test_worker_error_makes_engine_dead(checkpoint):
    """A step a worker refuses: the error comes back (no hang) and the engine is dead after."""
    ex = UniprocExecutor(checkpoint[1], **ARGS)
    with pytest.raises(EngineDeadError, match="never sent"):
        ex.execute({"scheduled": [{"id": "x", "num_computed": 0, "num_tokens": 1}]})
    with pytest.raises(EngineDeadError):
        ex.execute({})
    ex.shutdown()


def test_unsatisfiable_placement_group_fails_quickly(tp2, checkpoint):
    t = time.monotonic()
    with pytest.raises(PlacementGroupError, match=r"asked for 8 CPUs .* has 4 CPUs in total"):
        RayExecutor(checkpoint[1], tensor_parallel_size=8, placement_timeout_s=1.5, **ARGS)
    with pytest.raises(PlacementGroupError, match=r"asked for 2 GPUs .* has 0 GPUs in total"):
        RayExecutor(checkpoint[1], tensor_parallel_size=2, placement_timeout_s=1.5,
                    **{**ARGS, "device": "cuda"})
    assert time.monotonic() - t < 20
    assert ray.is_initialized()  # it joined the cluster: not its own to stop
    assert all(p["state"] in ("REMOVED", "CREATED") for p in ray.util.placement_group_table().values())
    assert sum(1 for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED") == 1  # tp2's
    tp2.check_health()


def test_killed_worker_makes_engine_dead_and_shutdown_frees_all(tp2, checkpoint):
    ex = RayExecutor(checkpoint[1], tensor_parallel_size=2, **ARGS)
    assert ray.available_resources().get("CPU", 0) == 0  # 2 + 2 of 4
    step = {"new": [{"id": "a", "token_ids": list(range(1, 11)), "block_ids": [[1, 2, 3]],
                     "sampling": {"temperature": 0.0}}],
            "scheduled": [{"id": "a", "num_computed": 0, "num_tokens": 10, "new_token_ids": [],
                           "new_block_ids": [[]], "sample": True}]}
    assert len(ex.execute(step)["token_ids"]) == 1
    actors, pg = list(ex.actors), ex.pg
    ray.kill(actors[1])
    t = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        ex.execute({"scheduled": [{"id": "a", "num_computed": 10, "num_tokens": 1, "new_token_ids": [5],
                                   "new_block_ids": [[]], "sample": True}]})
    assert time.monotonic() - t < 10
    t = time.monotonic()
    with pytest.raises(EngineDeadError):  # at once, every later call
        ex.execute({})
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
