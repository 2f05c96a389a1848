"""Property tests of the hybrid KV cache manager against a brute-force model of what each block holds.

A rule-based state machine plays a scheduler over random hybrid layouts (full attention, sliding
window, chunked local, Mamba) and small pools: it admits requests (prefix hit, then the first
chunk), runs chunked-prefill and decode steps, frees, preempts and resumes requests, and resets the
prefix cache. After every successful allocation it also plays the worker: it writes each
attention block's tokens and each Mamba page's state (as the state after `s` tokens of a request),
and checks that every read (the K/V a query attends to, the state a Mamba step starts from) finds
data computed from the request's own prefix.

Checked after every step:
1. each non-null block is in use (ref > 0, not queued), free and cached (ref 0, queued, its hash
   maps back to it), or free and uncached (ref 0, queued, no hash); the free queue is a well-formed
   list without duplicates whose count is its length (the never-used blocks, not created yet,
   count as free: they sit behind one sentinel node, after every unhashed block);
2. each ref count equals the number of table entries holding the block;
3. every prefix hit returns blocks holding exactly the request's tokens (and, since hashes chain,
   computed from the request's whole prefix, under the same cache salt); every registered hash
   names the content of its block;
4. a failed allocate_slots changes nothing;
5. at the end, with every request freed, the pool is empty and reset_prefix_cache succeeds.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from distengine.kv_cache import KVCacheManager, make_plan
from distengine.kv_cache.hashing import extend_block_hashes
from distengine.model_config import CHUNKED, FULL, MAMBA, SLIDING, LayerKV, MambaShape, ModelKVConfig
from distengine.kv_cache.specs import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec, cdiv
from distengine.request import Request
from tests.helpers import free_ids

REPO_ROOT = Path(__file__).resolve().parent.parent


# ---- layouts ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    block_size: int  # requested; raised by make_plan when Mamba layers are present
    types: tuple  # (FULL,), (SLIDING, window), (CHUNKED, chunk in blocks), (MAMBA,)
    counts: tuple  # layers of each type
    head_dim: int
    mamba: MambaShape
    max_len_blocks: int
    checkpoint_blocks: int | None = None  # Mamba checkpoint interval in blocks (None: the default)


_TYPES = st.one_of(
    st.just((FULL,)),
    st.tuples(st.just(SLIDING), st.integers(3, 40)),
    st.tuples(st.just(CHUNKED), st.integers(1, 3)),
    st.just((MAMBA,)),
)


@st.composite
def layouts(draw) -> Layout:
    types = draw(st.lists(_TYPES, min_size=1, max_size=3,
                          unique_by=lambda t: t[0] if t[0] in (FULL, MAMBA) else t))
    counts = draw(st.lists(st.integers(1, 4), min_size=len(types), max_size=len(types)))
    shape = MambaShape(1, draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(2, 4)))
    return Layout(draw(st.sampled_from([2, 4, 16])), tuple(types), tuple(counts), draw(st.integers(1, 2)),
                  shape, draw(st.integers(4, 12)), draw(st.sampled_from([None, 0, 1, 2, 3])))


def _layers(layout: Layout, chunk_unit: int) -> tuple[LayerKV, ...]:
    out = []
    for t, count in zip(layout.types, layout.counts):
        for _ in range(count):
            name = f"model.layers.{len(out)}"
            if t[0] == FULL:
                out.append(LayerKV(name, FULL, 1, layout.head_dim))
            elif t[0] == SLIDING:
                out.append(LayerKV(name, SLIDING, 1, layout.head_dim, window=t[1]))
            elif t[0] == CHUNKED:
                out.append(LayerKV(name, CHUNKED, 1, layout.head_dim, chunk=t[1] * chunk_unit))
            else:
                out.append(LayerKV(name, MAMBA, mamba=layout.mamba))
    return tuple(out)


def build_plan(layout: Layout):
    kinds = {t[0] for t in layout.types}
    bs = layout.block_size
    if MAMBA in kinds and kinds != {MAMBA}:
        # The attention block size is raised until a page holds a Mamba state: read it from a plan.
        # (One page per state: the layout choice only changes the block size, not the manager.)
        probe = ModelKVConfig("probe", "test", (LayerKV("a", FULL, 1, layout.head_dim),
                                                LayerKV("m", MAMBA, mamba=layout.mamba)), 1, 1 << 20)
        bs = make_plan(probe, block_size=layout.block_size, state_pages=1).block_size
    model = ModelKVConfig("random-hybrid", "test", _layers(layout, bs), 1, bs * layout.max_len_blocks)
    every = None if layout.checkpoint_blocks is None else layout.checkpoint_blocks * bs
    plan = make_plan(model, block_size=layout.block_size, state_pages=1, mamba_checkpoint_interval=every)
    assert plan.block_size == bs
    return plan


# ---- reference model of block contents ---------------------------------------------------------

class Content:
    """What the worker has written in one block (keyed by block id: groups share the buffers).

    Attention: tokens at positions [index*B, (index+1)*B) of `owner` (None = not written yet).
    Mamba: the state after the first `state_len` tokens of `owner` (None = garbage)."""

    __slots__ = ("group", "owner", "index", "tokens", "state_len")

    def __init__(self, group: int, owner: Request, index: int, block_size: int) -> None:
        self.group, self.owner, self.index = group, owner, index
        self.tokens: list[int | None] = [None] * block_size
        self.state_len: int | None = None


def read_lo(spec, num_computed: int) -> int:
    """First key position a query at position `num_computed` attends to."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, num_computed - spec.window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return num_computed // spec.chunk * spec.chunk
    return 0


class KVCacheMachine(RuleBasedStateMachine):
    # ---- setup -----------------------------------------------------------------------------
    @initialize(layout=layouts(), num_blocks=st.integers(8, 200),
                enable_caching=st.sampled_from([True, True, True, False]), vocab=st.sampled_from([1, 2, 4]))
    def setup(self, layout, num_blocks, enable_caching, vocab):
        self.plan = build_plan(layout)
        note(f"layout={layout} block_size={self.plan.block_size} groups="
             f"{[g.spec.describe() for g in self.plan.groups]} num_blocks={num_blocks} "
             f"caching={enable_caching} vocab={vocab}")
        self.mgr = KVCacheManager(self.plan, num_blocks, enable_caching)
        self.pool = self.mgr.pool
        self.null = self.pool.null_block
        self.B = self.plan.block_size
        self.max_len = self.plan.max_model_len
        self.num_blocks = num_blocks
        self.caching = enable_caching
        self.vocab = vocab
        self.specs = [g.spec for g in self.plan.groups]
        self.where = {}  # group -> (single-type manager, index of the group in it)
        for m in self.mgr.coordinator.managers:
            for j, g in enumerate(m.group_ids):
                self.where[g] = (m, j)
        assert sorted(self.where) == list(range(len(self.specs)))
        self.running: dict[str, Request] = {}
        self.waiting: list[Request] = []  # preempted, to be resumed
        self.history: list[list[int]] = []  # token lists that later prompts may share a prefix with
        self.content: dict[int, Content] = {}
        self.counter = 0

    def _ready(self) -> bool:
        return hasattr(self, "mgr")

    # ---- helpers ---------------------------------------------------------------------------
    def _table(self, req: Request, g: int):
        m, j = self.where[g]
        rb = m.requests.get(req.request_id)
        return None if rb is None else rb.tables[j]

    def _all_tables(self):
        for m in self.mgr.coordinator.managers:
            for rid, rb in m.requests.items():
                for j, table in enumerate(rb.tables):
                    yield m.group_ids[j], rid, table

    def _snapshot(self):
        # Created blocks only, and the free ids in pop order: iterating pool.blocks or the queue
        # would create every never-used block, and the lazy path would go untested after that.
        return ([b.ref_cnt for b in self.pool.free_queue.created], self.pool.num_free_blocks,
                free_ids(self.pool.free_queue),
                sorted((g, rid, tuple(b.block_id for b in t)) for g, rid, t in self._all_tables()),
                {rid: self.mgr.get_block_ids(rid) for rid in self.running})

    def _draw_prompt(self, data, lo: int, hi: int) -> list[int]:
        length = data.draw(st.integers(lo, hi), label="prompt length")
        base: list[int] = []
        if self.history and data.draw(st.booleans(), label="share a prefix"):
            base = data.draw(st.sampled_from(self.history), label="base")
            base = base[:data.draw(st.integers(0, len(base)), label="shared length")]
        n = max(0, length - len(base))
        suffix = data.draw(st.lists(st.integers(0, self.vocab - 1), min_size=n, max_size=n), label="suffix")
        return (base + suffix)[:length]

    def _draw_chunk(self, data):
        B = self.B
        return data.draw(st.one_of(st.none(), st.integers(1, 3 * B), st.sampled_from([B, 2 * B])), label="chunk")

    def _check_content(self, block, g: int, i: int, req: Request, why: str) -> None:
        """Block `block` at index i of group g holds what req's prefix up to (i+1)*B computes."""
        B, spec = self.B, self.specs[g]
        c = self.content.get(block.block_id)
        assert c is not None, f"{why}: block {block.block_id} was never written"
        assert c.group == g and c.index == i, \
            f"{why}: block {block.block_id} holds group {c.group} entry {c.index}, wanted group {g} entry {i}"
        assert c.owner.cache_salt == req.cache_salt, f"{why}: block {block.block_id} crosses cache salts"
        upto = (i + 1) * B
        if isinstance(spec, MambaSpec):
            assert c.state_len == upto, \
                f"{why}: Mamba block {block.block_id} at entry {i} holds the state after {c.state_len} tokens, not {upto}"
        else:
            assert c.tokens == req.all_token_ids[i * B:upto], \
                f"{why}: block {block.block_id} tokens {c.tokens} != request's {req.all_token_ids[i * B:upto]}"
        assert c.owner.all_token_ids[:upto] == req.all_token_ids[:upto], \
            f"{why}: block {block.block_id} was computed from another prefix"

    # ---- the worker's view of one step -----------------------------------------------------
    def _after_alloc(self, req: Request, T: int, N: int, out, hit_blocks=None) -> None:
        """Check the tables after a successful allocation for tokens [T, N), then run the step."""
        B, null = self.B, self.null
        assert isinstance(out, tuple) and len(out) == len(self.specs)
        ids = self.mgr.get_block_ids(req.request_id)
        for g, spec in enumerate(self.specs):
            table = self._table(req, g)
            assert table is not None
            assert ids[g] == [b.block_id for b in table]
            assert len(table) == cdiv(N, B), f"group {g}: {len(table)} entries for {N} tokens"
            app = out[g]
            if app:
                assert ids[g][len(table) - len(app):] == app
            if hit_blocks is not None:
                assert len(app) == len(table) - len(hit_blocks[g])
            for k, bid in enumerate(app):
                if bid:
                    block = self.pool.blocks[bid]
                    assert block.ref_cnt == 1, f"new block {bid} is shared (ref {block.ref_cnt})"
                    self.content[bid] = Content(g, req, len(table) - len(app) + k, B)
            first = spec.first_needed_block(T)
            # Blocks that left the window may be dropped up to B-1 tokens late (the quiet path of
            # allocate_slots defers dropping to the next block boundary), never later.
            dropped = spec.first_needed_block(max(0, T - B + 1))
            for i in range(min(dropped, len(table))):
                assert table[i] is null, f"group {g} ({spec.describe()}): entry {i} < {dropped} still held at {T}"
            if isinstance(spec, MambaSpec):
                if T > 0:  # the state the step starts from
                    i = (T - 1) // B
                    assert table[i] is not null, f"Mamba group {g}: entry {i} to read is null"
                    c = self.content[table[i].block_id]
                    assert c.group == g and c.index == i and c.state_len == T, \
                        f"Mamba group {g}: entry {i} holds the state after {c.state_len} tokens, reading at {T}"
                    assert c.owner.all_token_ids[:T] == req.all_token_ids[:T]
                # The worker writes the state at every block end inside the step whose entry is
                # not null (workers.mamba_metadata), and the state after the step's last token.
                ends = range((T // B + 1) * B, N, B)
                writes = [(e // B - 1, e) for e in ends if table[e // B - 1] is not null]
                lean = self.mgr.coordinator.last_allocation_lean  # a short pool: no checkpoints
                if self.caching and ends and N % B and not lean:  # the last block end before N is kept
                    assert table[ends[-1] // B - 1] is not null, f"Mamba group {g}: no checkpoint at {ends[-1]}"
                writes.append(((N - 1) // B, N))
                for i, s in writes:
                    block = table[i]
                    assert block is not null, f"Mamba group {g}: entry {i} to write is null"
                    c = self.content[block.block_id]
                    assert c.owner is req and c.group == g and c.index == i, \
                        f"Mamba group {g}: entry {i} written is not the request's own page"
                    c.state_len = s
            else:
                lo = read_lo(spec, T)
                for i in range(first, cdiv(N, B)):
                    assert table[i] is not null, f"group {g} ({spec.describe()}): needed entry {i} is null"
                for i in range(lo // B, cdiv(T, B)):  # keys attended to, computed before this step
                    c = self.content[table[i].block_id]
                    assert c.group == g and c.index == i
                    a, e = max(lo, i * B), min((i + 1) * B, T)
                    assert c.tokens[a - i * B:e - i * B] == req.all_token_ids[a:e], \
                        f"group {g}: entry {i} holds {c.tokens}, request has {req.all_token_ids[i * B:(i + 1) * B]}"
                    if c.owner is not req:
                        assert c.owner.all_token_ids[:e] == req.all_token_ids[:e]
                for i in range(T // B, cdiv(N, B)):  # keys written by this step
                    c = self.content[table[i].block_id]
                    assert c.owner is req and c.group == g and c.index == i, \
                        f"group {g}: entry {i} written is not the request's own block"
                    for p in range(max(T, i * B), min(N, (i + 1) * B)):
                        assert c.tokens[p - i * B] is None, f"position {p} written twice"
                        c.tokens[p - i * B] = req.all_token_ids[p]

    def _check_hit(self, req: Request, blocks, hit: int) -> None:
        B, null = self.B, self.null
        assert hit % B == 0 and 0 <= hit, hit
        assert hit < req.num_tokens or hit == 0, f"hit {hit} of {req.num_tokens} tokens leaves nothing to compute"
        if not self.caching:
            assert hit == 0
        assert len(blocks) == len(self.specs)
        for g, row in enumerate(blocks):
            assert len(row) == hit // B, f"group {g}: {len(row)} hit blocks for {hit} tokens"
            for i, block in enumerate(row):
                if block is null:
                    continue
                assert block.group_id == g and block.block_hash == req.block_hashes[i]
                self._check_content(block, g, i, req, f"prefix hit of {req.request_id} group {g}")
            for i in range(self.specs[g].first_needed_block(hit), hit // B):
                assert row[i] is not null, f"group {g}: hit leaves needed entry {i} null"

    def _admit(self, req: Request, data, resumed: bool) -> None:
        blocks, hit = self.mgr.get_computed_blocks(req)
        self._check_hit(req, blocks, hit)
        chunk = self._draw_chunk(data)
        remaining = req.num_tokens - hit
        num_new = remaining if chunk is None else min(remaining, chunk)
        before = self._snapshot()
        out = self.mgr.allocate_slots(req, num_new, hit, blocks)
        if out is None:
            assert self._snapshot() == before, "a failed admission changed the pool or the tables"
            if resumed:
                self.waiting.append(req)
            return
        self._after_alloc(req, hit, hit + num_new, out, hit_blocks=blocks)
        req.num_computed_tokens = hit + num_new
        self.running[req.request_id] = req

    def _new_request(self, prompt: list[int], data) -> Request:
        salt = data.draw(st.sampled_from([None, None, None, "a", "b"]), label="salt")
        self.counter += 1
        self.history.append(prompt)
        return Request(f"r{self.counter}", prompt, cache_salt=salt)

    def _free(self, req: Request) -> None:
        self.mgr.free(req)
        assert all(not row for row in self.mgr.get_block_ids(req.request_id))
        assert all(req.request_id not in m.requests for m in self.mgr.coordinator.managers)
        self.running.pop(req.request_id, None)
        self.history.append(list(req.all_token_ids))

    # ---- rules -----------------------------------------------------------------------------
    @precondition(_ready)
    @rule(data=st.data())
    def admit(self, data):
        prompt = self._draw_prompt(data, 1, min(self.max_len - 1, 4 * self.B))
        self._admit(self._new_request(prompt, data), data, resumed=False)

    @precondition(_ready)
    @rule(data=st.data())
    def admit_big(self, data):
        """Eviction pressure: a prompt of half to all of max_model_len."""
        prompt = self._draw_prompt(data, self.max_len // 2, self.max_len - 1)
        self._admit(self._new_request(prompt, data), data, resumed=False)

    @precondition(lambda self: self._ready() and self.waiting)
    @rule(data=st.data())
    def resume(self, data):
        req = self.waiting.pop(data.draw(st.integers(0, len(self.waiting) - 1), label="waiting index"))
        self._admit(req, data, resumed=True)

    @precondition(lambda self: self._ready() and self.running)
    @rule(data=st.data())
    def step(self, data):
        """One scheduler step of a running request: the next prefill chunk, or one decode token."""
        req = self.running[data.draw(st.sampled_from(sorted(self.running)), label="request")]
        T = req.num_computed_tokens
        if T == req.num_tokens:
            if req.num_tokens >= self.max_len:
                self._free(req)  # finished: max_model_len reached
                return
            req.append_output_token(data.draw(st.integers(0, self.vocab - 1), label="output token"))
            num_new = 1
        else:
            chunk = self._draw_chunk(data)
            num_new = req.num_tokens - T if chunk is None else min(req.num_tokens - T, chunk)
        before = self._snapshot()
        out = self.mgr.allocate_slots(req, num_new)
        if out is None:
            assert self._snapshot() == before, "a failed allocation changed the pool or the tables"
            if data.draw(st.booleans(), label="preempt"):
                self._preempt(req)
            return
        self._after_alloc(req, T, T + num_new, out)
        req.num_computed_tokens = T + num_new

    def _preempt(self, req: Request) -> None:
        self._free(req)
        req.num_computed_tokens = 0
        self.waiting.append(req)

    @precondition(lambda self: self._ready() and self.running)
    @rule(data=st.data())
    def finish(self, data):
        self._free(self.running[data.draw(st.sampled_from(sorted(self.running)), label="request")])

    @precondition(lambda self: self._ready() and self.running)
    @rule(data=st.data())
    def preempt(self, data):
        self._preempt(self.running[data.draw(st.sampled_from(sorted(self.running)), label="request")])

    @precondition(_ready)
    @rule(data=st.data())
    def look_up_block(self, data):
        """Index pool.blocks as tests and debugging do: a never-used block is created, with the
        ones before it, where the queue would hold it."""
        bid = data.draw(st.integers(0, self.num_blocks - 1), label="block id")
        assert self.pool.blocks[bid].block_id == bid
        assert self.pool.free_queue.fresh_start > bid

    @precondition(_ready)
    @rule()
    def reset_prefix_cache(self):
        holding = any(b is not self.null for _, _, t in self._all_tables() for b in t)
        assert holding == bool(self.running)
        assert self.mgr.reset_prefix_cache() == (not holding)
        if not holding:
            self._check_no_hashes()

    # ---- invariants ------------------------------------------------------------------------
    def _check_no_hashes(self):
        assert all(not table for table in self.pool.cached)
        assert all(b.block_hash is None for b in self.pool.free_queue.created)  # never-used ones have none

    @invariant()
    def pool_is_consistent(self):
        if not self._ready():
            return
        pool, null = self.pool, self.null
        queue = pool.free_queue
        # The free queue is a well-formed doubly linked list (checked by free_ids), the
        # never-used blocks' sentinel in the evict-first band after every unhashed block.
        ids = free_ids(queue)
        assert len(ids) == len(set(ids)), f"block twice in the free queue: {ids}"
        assert queue.num_free_blocks == len(ids) == self.mgr.num_free_blocks
        assert null.block_id not in ids and null.ref_cnt == 0 and null.block_hash is None
        fresh = range(queue.fresh_start, self.num_blocks)
        assert len(queue.created) == queue.fresh_start and pool.blocks[0] is null
        assert (queue.fresh.prev is not None) == bool(fresh), "the sentinel outlives the never-used blocks"
        if fresh:
            node = queue.fresh.prev
            while node is not queue.head:
                assert node.block_hash is None, f"cached block {node.block_id} ahead of never-used ones"
                node = node.prev
            node = queue.fresh
            while node is not queue.mid:
                assert node is not queue.tail, "never-used blocks in the normal band"
                node = node.next
        free = set(ids)
        refs = Counter(b.block_id for _, _, t in self._all_tables() for b in t if b is not null)
        # Never-used blocks (free_ids counts them free): in no table, never written.
        assert all(bid < queue.fresh_start for bid in refs) and all(bid < queue.fresh_start for bid in self.content)
        for block in queue.created[1:]:
            bid = block.block_id
            assert block.ref_cnt == refs[bid], f"block {bid}: ref {block.ref_cnt}, {refs[bid]} table entries"
            if block.ref_cnt > 0:
                assert bid not in free and block.prev is None and block.next is None, f"block {bid} in use and free"
            else:
                assert bid in free, f"block {bid} neither in use nor free"
            if block.block_hash is not None:
                assert pool.cached[block.group_id].get(block.block_hash) is block, f"block {bid}: stale hash"
                # A registered hash names the block's content.
                c = self.content.get(bid)
                assert c is not None and c.group == block.group_id
                assert block.block_hash == c.owner.block_hashes[c.index]
                self._check_content(block, c.group, c.index, c.owner, "cached block")
        for g, table in enumerate(pool.cached):
            for h, block in table.items():
                assert block is not null and block.block_hash == h and block.group_id == g
        in_use = sum(1 for b in queue.created[1:] if b.ref_cnt > 0)
        assert self.mgr.num_free_blocks == self.num_blocks - 1 - in_use
        assert abs(self.mgr.usage - in_use / (self.num_blocks - 1)) < 1e-9
        if not self.caching:
            self._check_no_hashes()

    def teardown(self):
        if not self._ready():
            return
        for req in list(self.running.values()):
            self._free(req)
        self.pool_is_consistent()
        assert self.mgr.num_free_blocks == self.num_blocks - 1
        assert self.mgr.usage == 0
        assert all(not m.requests for m in self.mgr.coordinator.managers)
        assert self.mgr.reset_prefix_cache() is True
        self._check_no_hashes()


KVCacheMachine.TestCase.settings = settings(
    max_examples=250, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
TestKVCacheManagerStateMachine = KVCacheMachine.TestCase


# ---- regressions found by the state machine -------------------------------------------------------

def _manager(layers, block_size, num_blocks):
    return KVCacheManager(make_plan(ModelKVConfig("m", "test", layers, 1, 64), block_size=block_size), num_blocks)


def test_free_prefix_hit_block_is_not_popped_by_an_earlier_group():
    """Group 2's prefix hit (a free block) was popped for group 1 in the same allocation."""
    mgr = _manager((LayerKV("f0", FULL, 1, 1), LayerKV("f1", FULL, 1, 1), LayerKV("s", SLIDING, 1, 1, window=3)),
                   2, 17)
    r1 = Request("r1", list(range(8)))
    assert mgr.allocate_slots(r1, 8) is not None
    r1.num_computed_tokens = 8
    r1.append_output_token(9)
    assert mgr.allocate_slots(r1, 1) is not None  # sliding entries 0..2 leave the window (freed, cached)
    r1.num_computed_tokens = 9
    r2 = Request("r2", [0, 1, 9])
    blocks, hit = mgr.get_computed_blocks(r2)
    assert hit == 2 and blocks[2][0].ref_cnt == 0
    assert mgr.allocate_slots(r2, 1, hit, blocks) is not None
    ids = [i for row in mgr.get_block_ids("r2") for i in row if i]
    assert len(ids) == len(set(ids)), mgr.get_block_ids("r2")
    assert mgr.get_block_ids("r2")[2][0] == blocks[2][0].block_id and blocks[2][0].ref_cnt == 1


def test_blocks_freed_by_a_later_group_count_for_an_earlier_one():
    """Full attention popped its block before chunked-local freed its out-of-chunk blocks."""
    mgr = _manager((LayerKV("f", FULL, 1, 1), LayerKV("c", CHUNKED, 1, 1, chunk=4)), 4, 5)
    r = Request("r", [0] * 8)
    assert mgr.allocate_slots(r, 8) is not None  # all 4 blocks
    r.num_computed_tokens = 8
    r.append_output_token(0)
    assert mgr.allocate_slots(r, 1) is not None  # net 0: full +1, chunked +1 -2
    assert mgr.num_free_blocks == 0


def test_mamba_running_page_is_finalised_at_its_block_end():
    """A step from mid-block across two block ends: the running page (state after T tokens) gets
    the state at its block's end (the worker writes every non-null entry whose block ends inside
    the step), so registering it under its block's hash is right. It once was registered while
    still holding the state after T tokens."""
    mgr = KVCacheManager(make_plan(ModelKVConfig("m", "test", (LayerKV("m", MAMBA, mamba=MambaShape(1, 1, 1, 2)),),
                                                 1, 64), block_size=2, mamba_checkpoint_interval=0), 20)
    r = Request("r", [0, 1, 2, 3, 4, 5])
    assert mgr.allocate_slots(r, 1) is not None  # [0, 1): state(1) -> entry 0
    r.num_computed_tokens = 1
    page = mgr.get_block_ids("r")[0][0]
    # [1, 5): state(2) -> entry 0 (the running page), state(4) -> entry 1 (the step's last block
    # end), state(5) -> entry 2.
    appended = mgr.allocate_slots(r, 4)
    assert appended is not None and all(appended[0])
    r.num_computed_tokens = 5
    mgr.free(r)
    assert mgr.pool.blocks[page].block_hash == r.block_hashes[0]
    blocks, hit = mgr.get_computed_blocks(Request("r2", [0, 1, 2, 3, 4, 9]))
    assert hit == 4 and blocks[0][1].block_id == appended[0][0]


# ---- hashing -----------------------------------------------------------------------------------

def test_block_hashes_are_deterministic_across_processes():
    rng = random.Random(1234)
    cases = [([rng.randrange(0, 1 << rng.choice([2, 16, 31])) for _ in range(rng.randrange(0, 100))],
              rng.choice([None, "", "salt", "ünïcode"])) for _ in range(40)]
    code = ("import json, sys\n"
            "from distengine.kv_cache.hashing import extend_block_hashes\n"
            "cases = json.load(sys.stdin)\n"
            "print(json.dumps([extend_block_hashes([], t, 16, s) for t, s in cases]))\n")
    env = {**os.environ, "PYTHONHASHSEED": "random", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), capture_output=True, text=True,
                          cwd=REPO_ROOT, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    theirs = json.loads(proc.stdout)
    ours = [extend_block_hashes([], t, 16, s) for t, s in cases]
    assert theirs == ours
    assert [len(h) for h in ours] == [len(t) // 16 for t, _ in cases]


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31 - 1), max_size=80), block_size=st.sampled_from([1, 2, 4, 16]),
       salt=st.text(max_size=6), other=st.text(max_size=6))
def test_cache_salt_changes_every_block_hash(tokens, block_size, salt, other):
    plain = extend_block_hashes([], tokens, block_size)
    salted = extend_block_hashes([], tokens, block_size, salt)
    assert len(plain) == len(salted) == len(tokens) // block_size
    assert not set(plain) & set(salted)
    if other != salt:
        assert all(a != b for a, b in zip(salted, extend_block_hashes([], tokens, block_size, other)))


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), block_size=st.sampled_from([1, 2, 4, 16]),
       cuts=st.lists(st.integers(0, 60), max_size=4), salt=st.sampled_from([None, "s"]))
def test_block_hashes_extend_incrementally_and_chain(tokens, block_size, cuts, salt):
    whole = extend_block_hashes([], tokens, block_size, salt)
    hashes: list[int] = []
    for n in sorted(cuts) + [len(tokens)]:
        extend_block_hashes(hashes, tokens, block_size, salt, num_tokens=min(n, len(tokens)))
        assert hashes == whole[:min(n, len(tokens)) // block_size]
    # A block's hash depends on its whole prefix: equal hashes <=> equal token prefixes.
    for i, h in enumerate(whole):
        assert h == extend_block_hashes([], tokens[:(i + 1) * block_size], block_size, salt)[-1]
    other = list(tokens)
    if other:
        other[0] += 1
        assert not set(extend_block_hashes([], other, block_size, salt)) & set(whole)
