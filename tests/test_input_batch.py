"""The persistent batch gives the model exactly the inputs of a plain flattening of each step
(`tests.reference_inputs.prepare_inputs` over the manager's own tables), over random step sequences
driven by the real scheduler: requests joining and finishing, aborted, preempted (a small pool),
chunked (a small token budget), with and without overlapped scheduling, as eager inputs and as
the padded inputs a decode CUDA graph reads. Block tables are compared where a step reads them
(entries the manager nulled may be stale in the batch: the invariant says nothing reads them),
and the invariant itself is asserted by the batch's debug checks on every step. The decode
graphs' one-launch kernel (`kernels.decode_inputs`) gives exactly what the torch path gives, on
some of those steps and on random tables."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from distengine.model_config import FULL, MAMBA, SLIDING, MambaShape
from distengine.sampling_params import SamplingParams
from distengine.scheduler import EngineRequest, Scheduler
from distengine.step import NewRequest, RequestSampling, ScheduledRequest, StepOutput
from kernels.decode_inputs import decode_inputs
from tests.helpers import plan_of
from workers.input_batch import InputBatch
from workers.staging import Staging
from tests.reference_inputs import SeqStep, prepare_inputs

VOCAB = 97
GRAPH_SIZES = [1, 2, 4, 6]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _kernel_matches_torch(batch: InputBatch, size: int) -> None:
    """`kernels.decode_inputs` on the batch's state (on DEVICE) equals the torch path, every
    element of every output (whole block-table rows, padded entries included)."""
    want = batch.decode_inputs_torch(size)
    groups = batch.tables.mamba_groups
    got = decode_inputs(batch.static[0, :size].to(DEVICE), batch.static[1, :size].to(DEVICE),
                        batch.last_token.to(DEVICE), batch.tables.tables.to(DEVICE),
                        None if groups is None else groups.to(DEVICE), batch.block_size)
    m = want.metadata
    assert torch.equal(got.input_ids.cpu(), want.input_ids) and torch.equal(got.positions.cpu(), want.positions)
    assert torch.equal(got.slot_mappings.cpu(), m.slot_mappings)
    assert torch.equal(got.block_tables.cpu(), m.block_tables)
    if m.mamba is None:
        assert got.init_pages is None and got.write_pages is None
    else:
        assert torch.equal(got.init_pages.cpu(), m.mamba.init_pages)
        assert torch.equal(got.write_pages.cpu(), m.mamba.write_pages)


def _check(batch: InputBatch, step, plan, sched: Scheduler, truth: dict[str, list[int]],
           check_kernel: bool = False) -> None:
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
        if check_kernel:
            _kernel_matches_torch(batch, size)
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
    assert got_meta.prompt_lens == meta.prompt_lens
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
            _check(batch, step, plan, sched, truth, check_kernel=graphs % 10 == 1)
            tokens = [rng.randrange(VOCAB) for _ in step.sample_req_ids]
            if rng.random() < 0.5:
                batch.record_sampled(step, torch.tensor(tokens, dtype=torch.int64), penalties=False)
            else:  # a greedy step: the argmax of logits that peak at the tokens, recorded in one pass
                logits = torch.zeros(len(tokens), VOCAB, dtype=torch.bfloat16)
                logits[range(len(tokens)), tokens] = 1.0
                assert batch.pick_greedy(step, logits).tolist() == tokens
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


def test_staging_keeps_its_fixed_region_as_it_grows():
    """The graphs read the fixed region at one address: each step's one copy writes it in place,
    and so do the two copies of a step after the buffer grew."""
    st = Staging(torch.device(DEVICE), capacity=16, fixed=8)
    address = st.fixed_region.data_ptr()
    for n in (4, 40, 400, 30):
        st.begin(8 + n)
        fixed, tail = st.put(np.arange(8) + n), st.put(np.arange(n) * 3)
        st.commit()
        assert fixed.offset == 0 and st.fixed_region.data_ptr() == address
        assert st.fixed_region.tolist() == list(range(n, n + 8))
        assert st.view(tail).tolist() == list(range(0, 3 * n, 3))
    assert st.dev.data_ptr() != address  # it did grow


@pytest.mark.parametrize("groups,mamba,width", [(1, [], 8), (3, [1], 2048 + 12), (4, [0, 2], 40)])
def test_decode_inputs_kernel_on_random_tables(groups, mamba, width):
    """Random tables with null entries, positions 0 (no state to read) up to the last entry,
    rows repeated and the padding row: the kernel equals the torch formulas element for element;
    bad shapes are refused."""
    g = torch.Generator().manual_seed(groups * 100 + width)
    R, S, B = 7, 9, 4
    tables = torch.randint(0, 50, (groups, R, width), generator=g, dtype=torch.int32)
    tables[:, R - 1] = 0  # the padding row
    rows = torch.randint(0, R, (S,), generator=g, dtype=torch.int32)
    rows[-1] = R - 1
    pos = torch.randint(0, width * B, (S,), generator=g, dtype=torch.int32)
    pos[0], pos[-1] = 0, 0
    last = torch.randint(0, 1000, (R,), generator=g, dtype=torch.int64)
    mg = torch.tensor(mamba, dtype=torch.int64) if mamba else None
    got = decode_inputs(rows.to(DEVICE), pos.to(DEVICE), last.to(DEVICE), tables.to(DEVICE),
                        None if mg is None else mg.to(DEVICE), B)
    r, p = rows.long(), pos.long()
    blocks = tables[:, r, p // B].long()
    assert torch.equal(got.input_ids.cpu(), last[r]) and torch.equal(got.positions.cpu(), p)
    assert torch.equal(got.slot_mappings.cpu(), torch.where(blocks > 0, blocks * B + p % B, -1))
    assert torch.equal(got.block_tables.cpu(), tables[:, r])
    if mg is None:
        assert got.init_pages is None
    else:
        init = torch.where(p > 0, tables[mg[:, None], r[None, :], ((p - 1) // B).clamp_min(0)[None, :]], 0)
        assert torch.equal(got.init_pages.cpu(), init)
        assert torch.equal(got.write_pages.cpu(), tables[mg[:, None], r[None, :], (p // B)[None, :]])
    with pytest.raises(ValueError, match="int32"):
        decode_inputs(rows.long().to(DEVICE), pos.to(DEVICE), last.to(DEVICE), tables.to(DEVICE), None, B)
    with pytest.raises(ValueError, match="last_token"):
        decode_inputs(rows.to(DEVICE), pos.to(DEVICE), last[:-1].to(DEVICE), tables.to(DEVICE), None, B)


def test_scan_chunks_end_only_where_a_state_is_kept():
    """Qwen3.6-27B's 208-token blocks: an 8,192-token prompt cut at every block end takes 158
    chunks (64, 64, 64, 16 a block); cut only where the manager keeps a state (the last block and
    one checkpoint), 64-token chunks from the prompt's start and from the checkpoint."""
    from workers.mamba_metadata import plan_chunks
    bs, n = 208, 8192
    every = plan_chunks(np.array([0]), np.array([n]), bs, 64)
    assert len(every[1]) == 158 and set(np.diff(every[0]).tolist()) == {16, 64}
    kept = {9, n // bs}  # the block ending at 2,080 and the last one
    start, seq, entry = plan_chunks(np.array([0]), np.array([n]), bs, 64, lambda s, e: e in kept)
    ends = start[1:].tolist()
    assert 2080 in ends and all((e if e <= 2080 else e - 2080) % 64 == 0 or e in (2080, n) for e in ends)
    assert len(seq) == 2080 // 64 + 1 + -(-(n - 2080) // 64)
    assert entry[ends.index(2080)] == 9 and entry[-1] == (n - 1) // bs
    # every chunk that ends at a block end names its entry (null ones write nothing); others -1
    assert all((e == ((x // bs) - 1 if x % bs == 0 and x != n else -1)) or x == n for x, e in zip(ends, entry))
    # a step starting inside a block: the first cut is that block's end when it keeps a state
    start, _, entry = plan_chunks(np.array([100]), np.array([300]), bs, 64, lambda s, e: e == 1)
    assert start.tolist() == [0, 64, 128, 192, 256, 300] and entry.tolist() == [-1, -1, -1, -1, 1]
