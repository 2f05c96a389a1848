"""The runner end to end on CPU: a checkpoint folder loaded by our loader, steps sent as
msgpack-serialisable plans (new requests once, then only new tokens and new blocks), a prefill
batched with decodes; greedy output equals transformers' generate()."""
from __future__ import annotations

import msgpack
import pytest
import torch

from distengine.kv_cache.manager import KVCacheManager
from distengine.request import Request
from tests.conftest import DEVICE
from tests.test_models import build
from workers.model_runner import KVCacheTooSmallError, ModelRunner


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf, _ = build("qwen3")
    folder = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(folder, max_shard_size="200KB")  # several shards and an index
    return hf, str(folder)


def _plan_step(mgr, runner_known, batch):
    """The scheduler's side of one step: allocate, then describe only what changed."""
    step = {"new": [], "scheduled": [], "finished": []}
    for req, n in batch:
        before = [len(t) for t in mgr.get_block_ids(req.request_id)]
        assert mgr.allocate_slots(req, n) is not None
        ids = mgr.get_block_ids(req.request_id)
        if req.request_id not in runner_known:
            runner_known[req.request_id] = req.num_tokens
            step["new"].append({"id": req.request_id, "token_ids": req.all_token_ids, "block_ids": list(ids),
                                "sampling": {"temperature": 0.0}})
            new_tokens, new_blocks = [], [[] for _ in ids]
        else:
            new_tokens = req.all_token_ids[runner_known[req.request_id]:]
            runner_known[req.request_id] = req.num_tokens
            new_blocks = [t[b:] for t, b in zip(ids, before)]
        step["scheduled"].append({"id": req.request_id, "num_computed": req.num_computed_tokens, "num_tokens": n,
                                  "new_token_ids": new_tokens, "new_block_ids": new_blocks, "sample": True})
    return msgpack.unpackb(msgpack.packb(step))  # plain data only


def test_runner_greedy_with_mixed_batches_matches_generate(checkpoint):
    hf, folder = checkpoint
    runner = ModelRunner(folder, device=DEVICE, dtype="float32", block_size=4, max_model_len=256)
    runner.allocate_kv_cache(400)
    mgr = KVCacheManager(runner.plan, runner.num_blocks)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (23, 31)]
    reqs = [Request(f"r{i}", p) for i, p in enumerate(prompts)]
    known: dict[str, int] = {}
    outputs = {r.request_id: [] for r in reqs}
    active = [(reqs[0], reqs[0].num_tokens)]
    for step_no in range(20):
        if step_no == 3:  # the second request's prefill joins the first one's decodes
            active.append((reqs[1], reqs[1].num_tokens))
        result = runner.execute(_plan_step(mgr, known, active))
        nxt = []
        for (req, n), tok in zip(active, result["token_ids"]):
            req.num_computed_tokens += n
            req.append_output_token(tok)
            outputs[req.request_id].append(tok)
            nxt.append((req, 1))
        active = nxt
    for req, prompt in zip(reqs, prompts):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=len(outputs[req.request_id]), do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        assert outputs[req.request_id] == want


def test_too_small_cache_says_what_fits(checkpoint):
    _, folder = checkpoint
    runner = ModelRunner(folder, dtype="float32", block_size=4, max_model_len=256)
    with pytest.raises(KVCacheTooSmallError, match=r"max_model_len <= \d+"):
        runner.allocate_kv_cache(20)


def test_unknown_request_is_refused(checkpoint):
    _, folder = checkpoint
    runner = ModelRunner(folder, dtype="float32", block_size=4, max_model_len=256)
    runner.allocate_kv_cache(200)
    with pytest.raises(KeyError, match="never sent"):
        runner.execute({"scheduled": [{"id": "x", "num_computed": 0, "num_tokens": 1}]})


def test_num_blocks_from_memory(checkpoint):
    """CPU: a fixed budget; GPU: what is left after a profiling pass at the largest batch."""
    _, folder = checkpoint
    runner = ModelRunner(folder, device=DEVICE, dtype="float32", block_size=4, max_model_len=256)
    n = runner.determine_num_blocks(gpu_memory_utilization=0.3, cpu_kv_cache_gib=0.01)
    if DEVICE == "cpu":
        assert n == int(0.01 * (1 << 30)) // runner.plan.block_bytes
    else:
        free, total = torch.cuda.mem_get_info()
        assert 0 < n * runner.plan.block_bytes < 0.3 * total
    with pytest.raises(KVCacheTooSmallError):
        runner.determine_num_blocks(gpu_memory_utilization=1e-9, cpu_kv_cache_gib=1e-9)
