"""The scheduler against a deterministic fake runner: the next token is a hash of the whole
sequence, so any scheduling mistake (a lost token, a wrong chunk, a block table out of sync)
changes the outputs. The fake keeps the runner's state from the plain-data steps and checks it
against the manager's after every step."""
from __future__ import annotations

import random
import zlib

import msgpack
import pytest

from distengine.kv_cache.model_config import FULL, SLIDING
from distengine.sampling_params import SamplingParams
from distengine.scheduler import EngineRequest, Scheduler
from tests.helpers import plan_of

VOCAB = 50


class FakeRunner:
    def __init__(self, scheduler: Scheduler) -> None:
        self.sched, self.tokens, self.tables = scheduler, {}, {}

    def execute(self, step: dict) -> dict:
        step = msgpack.unpackb(msgpack.packb(step))
        for rid in step["finished"]:
            self.tokens.pop(rid, None)
            self.tables.pop(rid, None)
        for r in step["new"]:
            self.tokens[r["id"]], self.tables[r["id"]] = list(r["token_ids"]), [list(t) for t in r["block_ids"]]
        out = []
        for s in step["scheduled"]:
            toks = self.tokens[s["id"]]
            toks.extend(s["new_token_ids"])
            for t, new in zip(self.tables[s["id"]], s["new_block_ids"]):
                t.extend(new)
            req = self.sched.requests[s["id"]]
            assert toks == req.all_token_ids
            mine, theirs = self.tables[s["id"]], self.sched.manager.get_block_ids(s["id"])
            for a, b in zip(mine, theirs):  # entries the manager nulled may be stale here
                assert len(a) == len(b) and all(x == y for x, y in zip(a, b) if y)
            if s["sample"]:
                out.append(zlib.crc32(repr(toks[: s["num_computed"] + s["num_tokens"]]).encode()) % VOCAB)
        return {"token_ids": out}


def run(prompts, num_blocks=400, budget=4096, max_num_seqs=64, caching=True, max_tokens=20, abort_prob=0.0,
        seed=0, **sp):
    plan = plan_of((FULL, 2), (SLIDING, 2), window=8, block_size=4, group_size=2, max_len=512)
    sched = Scheduler(plan, num_blocks, max_num_seqs, budget, caching)
    runner = FakeRunner(sched)
    reqs = [EngineRequest(str(i), p, sampling=SamplingParams(max_tokens=max_tokens, **sp)) for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    rng = random.Random(seed)
    for _ in range(10_000):
        if not sched.has_unfinished():
            break
        if abort_prob and sched.requests and rng.random() < abort_prob:
            sched.abort(rng.choice(sorted(sched.requests)))
            continue
        step, scheduled = sched.schedule()
        assert scheduled, "no progress"
        sched.update(scheduled, runner.execute(step)["token_ids"])
    assert not sched.has_unfinished()
    assert sched.manager.num_free_blocks == num_blocks - 1, "blocks leaked"
    return reqs, sched


PROMPTS = [[1, 2, 3] * 5 + [i % 7] * (3 + i) for i in range(12)]


def test_chunked_prefill_and_preemption_give_the_same_outputs():
    base, _ = run(PROMPTS)
    chunked, _ = run(PROMPTS, budget=7)
    small, sched = run(PROMPTS, num_blocks=40)
    assert sched.num_preemptions > 0
    for a, b, c in zip(base, chunked, small):
        assert a.output_token_ids == b.output_token_ids == c.output_token_ids
        assert len(a.output_token_ids) == 20 and a.finish_reason == "length"


def test_prefix_caching_on_and_off_agree_and_hit():
    on, sched = run(PROMPTS)
    off, _ = run(PROMPTS, caching=False)
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]
    assert max(r.num_cached_tokens for r in on) >= 12
    assert sched.stats().prefix_cache_hit_rate > 0


@pytest.mark.parametrize("seed", range(5))
def test_random_aborts_leave_the_pool_as_it_started(seed):
    reqs, _ = run(PROMPTS, num_blocks=60, budget=9, abort_prob=0.15, seed=seed)
    assert any(r.finish_reason == "abort" for r in reqs)


def test_stop_conditions():
    (r,), _ = run([[1, 2, 3]], max_tokens=50, stop_token_ids=list(range(VOCAB)), min_tokens=3)
    assert r.finish_reason == "stop" and len(r.output_token_ids) == 3 and r.stop_reason == r.output_token_ids[-1]
    plan = plan_of((FULL, 1), block_size=4, max_len=32)
    sched = Scheduler(plan, 100)
    req = EngineRequest("x", [1] * 30, sampling=SamplingParams(max_tokens=100))
    sched.add_request(req)
    runner = FakeRunner(sched)
    while sched.has_unfinished():
        step, scheduled = sched.schedule()
        sched.update(scheduled, runner.execute(step)["token_ids"])
    assert req.finish_reason == "length" and req.num_tokens == 32  # max_model_len
    eos = EngineRequest("y", [5, 6], sampling=SamplingParams(max_tokens=100), eos_token_ids=frozenset(range(VOCAB)))
    sched.add_request(eos)
    step, scheduled = sched.schedule()
    sched.update(scheduled, runner.execute(step)["token_ids"])
    assert eos.finish_reason == "stop" and len(eos.output_token_ids) == 1


def test_too_long_prompt_and_duplicate_id():
    sched = Scheduler(plan_of((FULL, 1), block_size=4, max_len=32), 100)
    with pytest.raises(ValueError, match=r"40 tokens.*max_model_len \(32\)"):
        sched.add_request(EngineRequest("a", [1] * 40))
    sched.add_request(EngineRequest("b", [1]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(EngineRequest("b", [2]))
