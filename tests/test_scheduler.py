"""The scheduler and the engine loop against a deterministic fake runner: the next token is a hash
of the whole sequence, so any scheduling mistake (a lost token, a wrong chunk, a block table out
of sync, a placeholder fed the wrong token) changes the outputs. The fake keeps the workers'
state from the typed steps (through msgpack) as a worker does: the token a request sampled stays
with the runner and is not resent. It checks its state against the manager's after every step.
Every test runs with overlapped scheduling (step N+1 scheduled before step N's tokens are known)
and without."""
from __future__ import annotations

import random
import zlib

import pytest

from distengine.config import EngineConfig
from distengine.engine_core import EngineCore, EngineInfo
from distengine.model_config import FULL, SLIDING
from distengine.sampling_params import SamplingParams
from distengine.scheduler import EngineRequest, Scheduler
from distengine.step import StepOutput, StepPlan
from tests.helpers import plan_of

VOCAB = 50
MODES = ["sync", "async"]


class FakeRunner:
    def __init__(self, scheduler: Scheduler) -> None:
        self.sched, self.tokens, self.tables, self.last = scheduler, {}, {}, {}

    def run(self, plan: StepPlan) -> StepOutput | None:
        plan = StepPlan.decode(plan.encode())
        for rid in plan.finished_req_ids:
            for d in (self.tokens, self.tables, self.last):
                d.pop(rid, None)
        for r in plan.new_requests:
            assert r.req_id not in self.tables
            self.tables[r.req_id] = [list(t) for t in r.block_ids]
            self.tokens[r.req_id] = None  # the prefix comes with its first scheduled entry
        out = StepOutput(plan.step_id)
        for s in plan.scheduled:
            req = self.sched.requests[s.req_id]
            if self.tokens[s.req_id] is None:  # a prefix hit is not resent: the workers don't need it
                self.tokens[s.req_id] = list(req.all_token_ids[:s.num_computed_tokens])
            seq = self.tokens[s.req_id]
            new = list(s.token_ids) + ([self.last[s.req_id]] if s.uses_device_token else [])
            assert len(new) == s.num_new_tokens and len(seq) >= s.num_computed_tokens
            del seq[s.num_computed_tokens:]
            seq.extend(new)
            known = min(len(req.all_token_ids), len(seq))
            assert seq[:known] == req.all_token_ids[:known]
            for t, ids in zip(self.tables[s.req_id], s.new_block_ids):
                t.extend(ids)
            mine, theirs = self.tables[s.req_id], self.sched.manager.get_block_ids(s.req_id)
            for a, b in zip(mine, theirs):  # entries the manager nulled may be stale here
                assert len(a) == len(b) and all(x == y for x, y in zip(a, b) if y)
            if s.sample:
                tok = zlib.crc32(repr(seq).encode()) % VOCAB
                self.last[s.req_id] = tok
                out.req_ids.append(s.req_id)
                out.token_ids.append(tok)
        return out if out.req_ids else None


class FakeExecutor:
    """What a worker does with `defer_output`: launch now, answer with the previous step's output."""

    def __init__(self) -> None:
        self.pending, self.runner = None, None

    def execute(self, plan: StepPlan) -> StepOutput | None:
        out = self.runner.run(plan)
        if not plan.defer_output:
            return out
        previous, self.pending = self.pending, out
        return previous

    def shutdown(self) -> None:
        pass


def make_core(num_blocks=400, budget=4096, max_num_seqs=64, caching=True, mode="sync", max_len=512):
    plan = plan_of((FULL, 2), (SLIDING, 2), window=8, block_size=4, group_size=2, max_len=max_len)
    config = EngineConfig(model="fake", max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          enable_prefix_caching=caching, async_scheduling=mode == "async", max_model_len=max_len)
    ex = FakeExecutor()
    core = EngineCore(config, ex, EngineInfo(config, plan, num_blocks, VOCAB, [], []))
    ex.runner = FakeRunner(core.scheduler)
    return core


def drain(core: EngineCore, abort_prob: float = 0.0, seed: int = 0) -> None:
    rng = random.Random(seed)
    sched = core.scheduler
    for _ in range(10_000):
        if not sched.has_unfinished() and not sched.has_in_flight():
            break
        if abort_prob and sched.requests and rng.random() < abort_prob:
            core.abort([rng.choice(sorted(sched.requests))])
            continue
        core.step()
    assert not sched.has_unfinished() and not sched.has_in_flight()


def run(prompts, num_blocks=400, budget=4096, max_num_seqs=64, caching=True, max_tokens=20, abort_prob=0.0,
        seed=0, mode="sync", **sp):
    core = make_core(num_blocks, budget, max_num_seqs, caching, mode)
    reqs = [EngineRequest(str(i), p, sampling=SamplingParams(max_tokens=max_tokens, **sp)) for i, p in enumerate(prompts)]
    for r in reqs:
        core.add_request(r)
    drain(core, abort_prob, seed)
    core.step()  # delivers the last finished ids to the runner
    sched = core.scheduler
    assert sched.manager.num_free_blocks == num_blocks - 1, "blocks leaked"
    assert not core.executor.runner.tables, "the runner kept finished requests"
    return reqs, sched


PROMPTS = [[1, 2, 3] * 5 + [i % 7] * (3 + i) for i in range(12)]


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_and_preemption_give_the_same_outputs(mode):
    base, _ = run(PROMPTS, mode=mode)
    chunked, _ = run(PROMPTS, budget=7, mode=mode)
    small, sched = run(PROMPTS, num_blocks=40, mode=mode)
    assert sched.num_preemptions > 0
    for a, b, c in zip(base, chunked, small):
        assert a.output_token_ids == b.output_token_ids == c.output_token_ids
        assert len(a.output_token_ids) == 20 and a.finish_reason == "length"


@pytest.mark.parametrize("mode", MODES)
def test_a_prompt_too_wide_for_the_pool_in_one_chunk_runs_in_smaller_ones(mode):
    """120-token prompts in one chunk would need 30 blocks in the full group and 30 in the sliding
    one (its chunk is written before anything leaves the window): more than the pool. The
    scheduler shrinks the chunk (the window frees blocks between chunks) rather than waiting
    forever or preempting the request in favour of itself; outputs as with a large pool."""
    long = [[i % 11 + 1] * 3 + list(range(1, 118)) for i in range(3)]
    base, _ = run(long, mode=mode)
    tight, _ = run(long, num_blocks=45, mode=mode)
    assert [r.output_token_ids for r in tight] == [r.output_token_ids for r in base]


def test_overlapped_scheduling_gives_the_same_outputs():
    for kw in ({}, dict(budget=7), dict(num_blocks=40), dict(max_num_seqs=3)):
        sync, _ = run(PROMPTS, mode="sync", **kw)
        over, _ = run(PROMPTS, mode="async", **kw)
        assert [r.output_token_ids for r in sync] == [r.output_token_ids for r in over], kw


@pytest.mark.parametrize("mode", MODES)
def test_prefix_caching_on_and_off_agree_and_hit(mode):
    on, sched = run(PROMPTS, mode=mode)
    off, _ = run(PROMPTS, caching=False, mode=mode)
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]
    assert max(r.num_cached_tokens for r in on) >= 12
    assert sched.stats().prefix_cache_hit_rate > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(4))
def test_random_aborts_leave_the_pool_as_it_started(seed, mode):
    reqs, _ = run(PROMPTS, num_blocks=60, budget=9, abort_prob=0.15, seed=seed, mode=mode)
    assert any(r.finish_reason == "abort" for r in reqs)


@pytest.mark.parametrize("mode", MODES)
def test_stop_conditions(mode):
    (r,), _ = run([[1, 2, 3]], max_tokens=50, stop_token_ids=list(range(VOCAB)), min_tokens=3, mode=mode)
    assert r.finish_reason == "stop" and len(r.output_token_ids) == 3 and r.stop_reason == r.output_token_ids[-1]
    core = make_core(mode=mode, max_len=32)
    req = EngineRequest("x", [1] * 30, sampling=SamplingParams(max_tokens=100))
    core.add_request(req)
    drain(core)
    assert req.finish_reason == "length" and req.num_tokens == 32  # max_model_len
    eos = EngineRequest("y", [5, 6], sampling=SamplingParams(max_tokens=100), eos_token_ids=frozenset(range(VOCAB)))
    core.add_request(eos)
    drain(core)
    assert eos.finish_reason == "stop" and len(eos.output_token_ids) == 1


def test_a_request_is_not_scheduled_past_its_end():
    """Overlapped: once the tokens in flight will end a request, it gets no further step."""
    core = make_core(mode="async")
    req = EngineRequest("a", [1, 2, 3], sampling=SamplingParams(max_tokens=4))
    core.add_request(req)
    computed = []
    while core.scheduler.has_unfinished() or core.scheduler.has_in_flight():
        core.step()
        computed.append(req.num_computed_tokens)
    assert req.output_token_ids and len(req.output_token_ids) == 4
    assert max(computed) <= 3 + 4 - 1  # the last token is sampled, never computed


def test_too_long_prompt_and_duplicate_id():
    sched = Scheduler(plan_of((FULL, 1), block_size=4, max_len=32), 100, max_num_seqs=8, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match=r"40 tokens.*max_model_len \(32\)"):
        sched.add_request(EngineRequest("a", [1] * 40))
    sched.add_request(EngineRequest("b", [1]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(EngineRequest("b", [2]))


def test_steps_round_trip_msgpack():
    from distengine.step import NewRequest, RequestSampling, ScheduledRequest
    plan = StepPlan(7, [NewRequest("a", [[1, 2], [0, 3]], RequestSampling(temperature=0.5, seed=-(1 << 63)), 2,
                                   [4, 5], [6])],
                    [ScheduledRequest("a", 3, 2, [8], [[9], []], True), ScheduledRequest("b", 0, 1, [1], [], False)],
                    ["z"], True)
    assert StepPlan.decode(plan.encode()) == plan
    out = StepOutput(7, ["a"], [3], [-0.5], [[3, 1]], [[-0.5, -2.0]])
    assert StepOutput.decode(out.encode()) == out
    assert plan.scheduled[0].uses_device_token and not plan.scheduled[1].uses_device_token
