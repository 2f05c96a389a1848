"""The persistent batch gives the model exactly the inputs of a plain flattening of each step
(`tests.reference_inputs.prepare_inputs` over the manager's own tables), over random step sequences
driven by the real scheduler: requests joining and finishing, aborted, preempted (a small pool),
chunked (a small token budget), with and without overlapped scheduling, as eager inputs and as
the padded inputs a decode CUDA graph reads. Block tables are compared where a step reads them
(entries the manager nulled may be stale in the batch: the invariant says nothing reads them),
and the invariant itself is asserted by the batch's debug checks on every step."""
from __future__ import annotations

import random

import pytest
import torch

from distengine.model_config import FULL, MAMBA, SLIDING, MambaShape
from distengine.sampling_params import SamplingParams
from distengine.scheduler import EngineRequest, Scheduler
from distengine.step import NewRequest, RequestSampling, ScheduledRequest, StepOutput
from tests.helpers import plan_of
from workers.input_batch import InputBatch
from tests.reference_inputs import SeqStep, prepare_inputs

VOCAB = 97
GRAPH_SIZES = [1, 2, 4, 6]


def _check(batch: InputBatch, step, plan, sched: Scheduler, truth: dict[str, list[int]]) -> None:
    bs = batch.block_size
    seqs = [SeqStep(truth[s.req_id][s.num_computed_tokens:s.num_computed_tokens + s.num_new_tokens],
                    s.num_computed_tokens, [list(t) for t in sched.manager.get_block_ids(s.req_id)], s.sample)
            for s in plan.scheduled]
    mamba_groups = [g.group_id for g in batch.plan.groups if g.spec.kind == MAMBA]  # plan order
    ids, pos, meta, idx = prepare_inputs(seqs, bs, torch.device("cpu"), mamba_groups)
    S = len(seqs)
    if step.graph_size is not None:
        size = step.graph_size
        g = batch.decode_inputs(size)
        g_ids, g_pos, g_meta = g.input_ids, g.positions, g.metadata
        assert torch.equal(g_ids[:S], ids) and torch.equal(g_pos[:S], pos)
        assert (g_meta.seq_lens[S:] == 0).all() and (g_meta.slot_mappings[:, S:] == -1).all()
        assert torch.equal(g_meta.query_start_loc, torch.arange(size + 1, dtype=torch.int32))
        got_meta, got_idx = g_meta, torch.tensor([i for i, s in enumerate(plan.scheduled) if s.sample])
        assert torch.equal(idx, torch.arange(S)[got_idx])
    else:
        e = batch.eager_inputs(step)
        e_ids, e_pos, got_meta, got_idx = e.input_ids, e.positions, e.metadata, e.logits_indices
        assert torch.equal(e_ids, ids) and torch.equal(e_pos, pos) and torch.equal(got_idx, idx)
        assert torch.equal(got_meta.query_start_loc, meta.query_start_loc)
        assert got_meta.max_query_len == meta.max_query_len
        assert got_meta.max_seq_len == (batch.max_model_len if meta.max_query_len == 1 else meta.max_seq_len)
    assert torch.equal(got_meta.seq_lens[:S], meta.seq_lens)
    if mamba_groups:
        m, got = meta.mamba, got_meta.mamba
        assert torch.equal(got.init_pages[:, :S], m.init_pages)
        if step.graph_size is not None:  # padded entries read and write nothing
            assert got.decode and (got.init_pages[:, S:] <= 0).all() and (got.write_pages[:, S:] <= 0).all()
        assert got.decode == m.decode
        if m.decode:
            assert torch.equal(got.write_pages[:, :S], m.write_pages)
        else:
            for name in ("chunk_start", "chunk_seq", "chunk_pages"):
                assert torch.equal(getattr(got, name), getattr(m, name)), name
    for g, first in enumerate(batch.tables._first_needed):
        assert torch.equal(got_meta.slot_mappings[g][:len(ids)], meta.slot_mappings[g])
        for i, s in enumerate(plan.scheduled):
            lo, hi = first(s.num_computed_tokens), -(-(s.num_computed_tokens + s.num_new_tokens) // bs)
            assert torch.equal(got_meta.block_tables[g][i, lo:hi], meta.block_tables[g][i, lo:hi].to(torch.int32))


PLANS = {
    "sliding": lambda: plan_of((FULL, 2), (SLIDING, 4), window=8, block_size=4, group_size=2, max_len=256),
    # Mamba states (checkpoints every 2 blocks) beside full attention.
    "mamba": lambda: plan_of((FULL, 2), (MAMBA, 4), kv_heads=1, head_dim=4, block_size=4, group_size=2, max_len=256,
                             mamba=MambaShape(1, 4, 2, 3), mamba_checkpoint_interval=16),
}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("layout", sorted(PLANS))
def test_persistent_batch_equals_plain_flattening(seed, overlap, layout):
    rng = random.Random(seed)
    plan_ = PLANS[layout]()
    num_blocks = rng.choice([30, 45, 400])
    sched = Scheduler(plan_, num_blocks, max_num_seqs=6, max_num_batched_tokens=rng.choice([9, 24, 512]))
    batch = InputBatch(plan_, 6, VOCAB, torch.device("cpu"), debug_checks=True)
    truth: dict[str, list[int]] = {}
    shared = [rng.randrange(VOCAB) for _ in range(14)]
    n_req, in_flight, steps, graphs = 0, None, 0, 0

    def apply(out_plan, tokens):
        nonlocal in_flight
        out = StepOutput(out_plan.step_id, [s.req_id for s in out_plan.scheduled if s.sample], tokens)
        sched.update(out.step_id, out)

    while steps < 300 and (n_req < 14 or sched.has_unfinished() or in_flight):
        steps += 1
        if n_req < 14 and rng.random() < 0.3:
            prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
            rid = f"r{n_req}"
            sched.add_request(EngineRequest(rid, prompt, sampling=SamplingParams(max_tokens=rng.randint(1, 25))))
            truth[rid] = list(prompt)
            n_req += 1
        if sched.requests and rng.random() < 0.05:
            sched.abort(rng.choice(sorted(sched.requests)))
        plan = sched.schedule()
        for rid in plan.finished_req_ids:
            batch.remove(rid)
        for r in plan.new_requests:
            batch.add(r)
        if plan.scheduled:
            step = batch.prepare(plan.scheduled, GRAPH_SIZES if rng.random() < 0.7 else None)
            graphs += step.graph_size is not None
            _check(batch, step, plan, sched, truth)
            tokens = [rng.randrange(VOCAB) for _ in step.sample_req_ids]
            batch.record_sampled(step, torch.tensor(tokens, dtype=torch.int64), penalties=False)
            for rid, t in zip(step.sample_req_ids, tokens):
                if rid in sched.requests or any(rid == s.req_id for s in plan.scheduled):
                    truth[rid].append(t)
        else:
            tokens = []
        if overlap:
            previous, in_flight = in_flight, (plan, tokens) if plan.scheduled else None
            if previous:
                apply(*previous)
        else:
            apply(plan, tokens)
    assert graphs > 0
    assert not sched.has_unfinished()


def test_bad_steps_are_refused():
    p = plan_of((FULL, 1), block_size=4, max_len=32)
    batch = InputBatch(p, 2, VOCAB, torch.device("cpu"))
    with pytest.raises(KeyError, match="never sent"):
        batch.prepare([ScheduledRequest("x", 0, 1, [1], [], True)], None)
    batch.add(NewRequest("a", [[1, 2]], RequestSampling()))
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add(NewRequest("a", [[3]], RequestSampling()))
    with pytest.raises(ValueError, match="has not sampled yet"):
        batch.prepare([ScheduledRequest("a", 0, 1, [], [], True)], None)
    with pytest.raises(ValueError, match=r"token id 97 outside the vocabulary \[0, 97\)"):
        batch.prepare([ScheduledRequest("a", 0, 2, [1, 97], [], True)], None)
    with pytest.raises(ValueError, match="outside"):
        batch.prepare([ScheduledRequest("a", 30, 4, [1, 2, 3, 4], [], True)], None)
    batch.add(NewRequest("b", [[3]], RequestSampling()))
    with pytest.raises(ValueError, match="the batch is full"):
        batch.add(NewRequest("c", [[4]], RequestSampling()))
