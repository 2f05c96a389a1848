"""The hybrid KV cache manager: the issue's worked cases and each manager's rules."""
from __future__ import annotations

import pytest

from distengine.kv_cache.block_pool import EVICT_FIRST, NORMAL
from distengine.kv_cache.hashing import extend_block_hashes
from distengine.model_config import CHUNKED, CROSS, FULL, MAMBA, SLIDING, MambaShape
from distengine.kv_cache.single_type_manager import SlidingWindowManager
from distengine.kv_cache.specs import SlidingWindowSpec
from distengine.kv_cache.block_pool import BlockPool
from distengine.request import Request
from tests.helpers import admit, decode, held, manager, plan_of


def test_worked_case_10_full_20_sliding():
    plan = plan_of((FULL, 10), (SLIDING, 20), window=32)
    assert [(g.spec.kind, len(g.layers), g.padding) for g in plan.groups] == [
        ("full_attention", 10, 0), ("sliding_window", 10, 0), ("sliding_window", 10, 0)]
    assert plan.blocks_per_group(112) == [7, 2, 2]
    mgr = manager(plan, 100)
    req = Request("a", list(range(112)))
    admit(mgr, req)
    mgr.allocate_slots(req, 0)  # the next step's allocation drops what left the window
    ids = mgr.get_block_ids("a")
    assert held(mgr, "a") == [7, 2, 2]
    assert sum(held(mgr, "a")) == 11
    for sliding in ids[1:]:
        assert sliding[:5] == [0] * 5 and all(sliding[5:])
    assert mgr.num_free_blocks == 99 - 11


def test_gemma_3_27b_group_size_and_bytes():
    from distengine.model_config import load_config_dict, parse_model_config
    from distengine.kv_cache.plan import make_plan, plan_with_group_size
    name, cfg = load_config_dict("gemma-3-27b")
    m = parse_model_config(cfg, name)
    assert sum(layer.kind == FULL for layer in m.layers) == 10
    assert sum(layer.kind == SLIDING for layer in m.layers) == 52
    plan = make_plan(m)
    page = 16 * 2 * 16 * 128 * 2  # block x (K+V) x 16 KV heads x head 128 x bf16
    assert plan.page_size_bytes == page
    assert (plan.num_slots, len(plan.groups), plan.choice.padding_slots) == (5, 13, 3)
    assert (plan.baseline.group_size, plan.baseline.num_groups, plan.baseline.padding_slots) == (10, 7, 8)
    vllm = plan_with_group_size(plan, 10)
    for tokens in (8192, 131072):
        full_blocks, window_blocks = tokens // 16, 64  # the last 1023 tokens span 64 blocks here
        assert plan.blocks_per_group(tokens) == [full_blocks] * 2 + [window_blocks] * 11
        assert plan.bytes_per_request(tokens) == (2 * full_blocks + 11 * window_blocks) * 5 * page
        assert vllm.bytes_per_request(tokens) == (full_blocks + 6 * window_blocks) * 10 * page
        assert plan.uniform_bytes_per_request(tokens) == 62 * full_blocks * page
        assert plan.bytes_per_request(tokens) < vllm.bytes_per_request(tokens)


def test_shared_prefix_hit_and_refcounts():
    mgr = manager(plan_of((FULL, 2)), 20)
    a = Request("a", list(range(55)))
    new, hit = admit(mgr, a)
    assert hit == 0 and len(new[0]) == 4
    b = Request("b", list(range(48)) + [999] * 7)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 48 and [x.block_id for x in blocks[0]] == mgr.get_block_ids("a")[0][:3]
    new = mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    assert len(new[0]) == 1
    pool = mgr.pool
    assert [pool.blocks[i].ref_cnt for i in mgr.get_block_ids("a")[0]] == [2, 2, 2, 1]
    assert mgr.prefix_cache_stats.hits == 48 and mgr.prefix_cache_stats.queries == 55 + 55


def test_failed_allocation_changes_nothing():
    plan = plan_of((FULL, 1), (SLIDING, 1), window=8, group_size=1)
    mgr = manager(plan, 12)
    a = Request("a", list(range(40)))
    admit(mgr, a)
    b = Request("b", list(range(32)) + [5] * 40)
    before = [(blk.ref_cnt, blk.block_hash) for blk in mgr.pool.blocks], mgr.num_free_blocks
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 32
    assert mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks) is None
    assert ([(blk.ref_cnt, blk.block_hash) for blk in mgr.pool.blocks], mgr.num_free_blocks) == before
    assert mgr.get_block_ids("b") == ([], [])
    # A running request that cannot grow: also no change (its skipped blocks are not freed).
    while decode(mgr, a) is not None:
        pass
    snapshot = [(blk.ref_cnt, blk.block_hash) for blk in mgr.pool.blocks], mgr.get_block_ids("a")
    assert mgr.allocate_slots(a, 1) is None
    assert ([(blk.ref_cnt, blk.block_hash) for blk in mgr.pool.blocks], mgr.get_block_ids("a")) == snapshot


@pytest.mark.parametrize("cached, hit_blocks", [
    ([False] * 10, 0), ([True], 1), ([True, False], 1), ([True, True], 2), ([True, True, False], 2),
    ([True, True, True], 3),
    ([True, True, False, True, False, False, True, True, False, True, True, True], 12),
    ([True, True, False, True, False, False, True, True, False, False, False], 8),
    ([True, True, False, True, False, False, True, True, False, False, False, True], 8),
])
def test_sliding_window_hit_scans_from_the_right(cached, hit_blocks):
    spec = SlidingWindowSpec(2, 4, window=4)  # block 2, window 4: a hit needs 2 contiguous blocks
    pool = BlockPool(50, 1)
    mgr = SlidingWindowManager(spec, [0], pool)
    hashes = extend_block_hashes([], list(range(2 * len(cached))), 2)
    for i, c in enumerate(cached):
        if c:
            pool.cache_block(pool.blocks[10 + i], hashes[i], 0)
    blocks, num_tokens = mgr.find_longest_cache_hit(hashes, 2 * len(cached))
    assert num_tokens == 2 * hit_blocks and len(blocks[0]) == hit_blocks
    # The last two entries are the cached run; everything before it is the null block.
    for i, blk in enumerate(blocks[0]):
        if i >= hit_blocks - 2:
            assert blk.block_id == 10 + i
        else:
            assert blk is pool.null_block


def _sliding_groups_model():
    return plan_of((FULL, 2), (SLIDING, 4), window=8, block_size=4, group_size=2)


def _evict(pool: BlockPool, group_id: int, block_hash: int) -> None:
    """What popping a free cached block for reuse does to it."""
    block = pool.cached[group_id].pop(block_hash)
    pool.free_queue.remove(block)
    block.block_hash = None
    pool.free_queue.appendleft(block)


def test_hybrid_hit_is_the_intersection_and_shrinks_by_each_rule():
    plan = _sliding_groups_model()
    assert [g.spec.kind for g in plan.groups] == [FULL, SLIDING, SLIDING]
    mgr = manager(plan, 200)
    a = Request("a", list(range(64)))
    admit(mgr, a)
    mgr.free(a)  # every block stays cached
    probe = Request("p", list(range(64)) + [1000])
    _, hit = mgr.get_computed_blocks(probe)
    assert hit == 64
    ids = mgr.get_block_ids("a")  # empty now: read the cached map instead
    assert ids == ([], [], [])
    hashes = probe.block_hashes
    # Evict sliding group 1's block 14 (tokens 56-59): the window (7 tokens) before 64 needs
    # blocks 14 and 15, so the sliding rule finds the next run of 2 cached blocks, ending at 14.
    _evict(mgr.pool, 1, hashes[14])
    _, hit = mgr.get_computed_blocks(Request("q", list(range(64)) + [1000]))
    assert hit == 56  # blocks 12, 13 end the hit
    # Evict the full group's block 5: a full hit stops at the first missing block, and the
    # sliding groups must then hit at 20 tokens (blocks 3, 4 cached): the intersection.
    _evict(mgr.pool, 0, hashes[5])
    blocks, hit = mgr.get_computed_blocks(Request("r", list(range(64)) + [1000]))
    assert hit == 20
    assert [len(b) for b in blocks] == [5, 5, 5]
    assert all(b is mgr.pool.null_block for b in blocks[1][:3]) and all(b.block_id for b in blocks[1][3:])


def test_freed_blocks_order_and_bands():
    plan = _sliding_groups_model()
    mgr = manager(plan, 200)
    a = Request("a", list(range(30)))  # 7 full blocks + a partial one
    admit(mgr, a)
    mgr.allocate_slots(a, 0)  # skips sliding blocks out of the window -> evict-first band
    queue = list(mgr.pool.free_queue)
    skipped = [b for b in queue if b.block_hash is not None]
    # Window 8: the next query (position 30) reads 23..29, so blocks 0-4 of both sliding groups go.
    assert len(skipped) == 2 * 5
    full_ids = mgr.get_block_ids("a")[0]
    mgr.free(a)
    queue = list(mgr.pool.free_queue)
    # The unhashed partial blocks come first, then the evict-first band, then the request's full
    # blocks tail first, so its tail is evicted first.
    unhashed = [b for b in queue if b.block_hash is None]
    assert queue[:3] == unhashed[:3]
    order = [b.block_id for b in queue if b.block_id in full_ids[:7]]
    assert order == list(reversed(full_ids[:7]))
    first_full = min(queue.index(mgr.pool.blocks[i]) for i in full_ids[:7])
    assert all(queue.index(b) < first_full for b in skipped)


def _band_of(pool, block_id: int) -> int | None:
    queue = pool.free_queue
    node, band = queue.head.next, EVICT_FIRST
    while node is not queue.tail:
        if node is queue.mid:
            band = NORMAL
        elif node is queue.fresh:  # stands for the never-used blocks, not created yet
            if block_id >= queue.fresh_start:
                return band
        elif node.block_id == block_id:
            return band
        node = node.next
    return None


def test_blocks_ending_a_shared_prompt_are_kept_longer():
    plan = _sliding_groups_model()  # block 4, window 8: a hit needs 2 blocks before its end
    mgr = manager(plan, 400)
    system = list(range(40))
    a = Request("a", system + [500] * 3)
    admit(mgr, a)
    b = Request("b", system + [600] * 30)
    _, hit = admit(mgr, b)
    assert hit == 40
    ends_prompt = mgr.get_block_ids("b")[1][8]  # block 8 (tokens 32-35) ends the shared prompt
    middle = mgr.get_block_ids("a")[1][5]  # tokens 20-23: never hit
    mgr.allocate_slots(a, 0)  # a's window (36..42) drops blocks 0-8: block 8 is still b's
    assert _band_of(mgr.pool, middle) == EVICT_FIRST
    assert _band_of(mgr.pool, ends_prompt) is None
    mgr.allocate_slots(b, 0)  # b's window moves past the prompt: b releases block 8 last
    assert _band_of(mgr.pool, ends_prompt) == NORMAL
    mgr.free(a)
    mgr.free(b)
    assert mgr.num_free_blocks == 399


def test_chunked_local_frees_blocks_before_the_chunk_and_hits():
    plan = plan_of((FULL, 1), (CHUNKED, 1), chunk=16, block_size=4, group_size=1)
    mgr = manager(plan, 100)
    a = Request("a", list(range(37)))
    admit(mgr, a)
    mgr.allocate_slots(a, 0)
    # Next query is position 37, chunk 2 (32..47): only block 8 (32-35) and 9 (36) are read.
    assert held(mgr, "a") == [10, 2]
    mgr.free(a)
    # A hit on the chunked group only needs the blocks of the chunk holding the hit's end.
    _, hit = mgr.get_computed_blocks(Request("b", list(range(37)) + [1]))
    assert hit == 36
    assert plan.blocks_per_group(37) == [10, 2]


def _mamba_plan(**kw):
    shape = MambaShape(1, 16, 4, 4)  # 3*16 + 16*4 = 112 elements = 224 bytes
    # attention: 2 * 1 * 4 * 2 = 16 bytes/token; block raised to 4 * cdiv(224, 64) = 16 tokens
    return plan_of((FULL, 1), (MAMBA, 1), kv_heads=1, head_dim=4, block_size=4, group_size=1, mamba=shape, **kw)


def test_mamba_state_pages_and_prefix_hit():
    plan = _mamba_plan(mamba_checkpoint_interval=0)
    assert plan.block_size == 16 and plan.page_size_bytes == 256
    mgr = manager(plan, 100)
    a = Request("a", list(range(40)))
    new, _ = admit(mgr, a)
    # No periodic checkpoints: entry 0 null, entry 1 keeps the state at the step's last block
    # end (token 32), entry 2 the running one.
    assert new[1][0] == 0 and all(new[1][1:]) and len(new[1]) == 3
    for _ in range(30):
        decode(mgr, a)
    assert held(mgr, "a")[1] <= 2
    mgr.free(a)
    # A prompt sharing 64 tokens restores the state cached at token 48 or 64.
    b = Request("b", list(range(40)) + [7] * 30 + [3] * 5)
    blocks, hit = mgr.get_computed_blocks(b)
    assert hit == 64
    assert sum(1 for x in blocks[1] if x is not mgr.pool.null_block) == 1
    new = mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks)
    assert new is not None and new[1][-1] not in [x.block_id for x in blocks[1]]
    b.num_computed_tokens = b.num_tokens
    mgr.free(b)
    assert mgr.num_free_blocks == 99


def test_mamba_checkpoints_every_interval_and_where_prompts_diverge():
    plan = _mamba_plan(mamba_checkpoint_interval=32)
    mgr = manager(plan, 200)
    system = list(range(100))
    a = Request("a", system + [1] * 60)
    new, hit = admit(mgr, a)
    # Block ends 32, 64, 96, 128 are kept (every 32 tokens), and entry 9 holds the state at 160,
    # the prompt's end; 16, 48, 80, 112 and 144 are not.
    kept = [i for i, b in enumerate(new[1]) if b]
    assert hit == 0 and kept == [1, 3, 5, 7, 9]
    mgr.free(a)
    # b shares 100 tokens with a: the attention blocks hit 96 tokens, the Mamba states 96 too.
    b = Request("b", system + [2] * 60)
    new, hit = admit(mgr, b)
    assert hit == 96
    mgr.free(b)
    # With checkpoints every 64 tokens, the first prompt sharing the prefix hits 64 tokens only,
    # but keeps the state at 96, where its prompt leaves the cached attention blocks: the next
    # one hits 96.
    mgr = manager(_mamba_plan(mamba_checkpoint_interval=64), 200)
    for rid, suffix, want in (("a", 1, 0), ("b", 2, 64), ("c", 3, 96)):
        r = Request(rid, system + [suffix] * 60)
        new, hit = admit(mgr, r)
        assert hit == want, rid
        mgr.free(r)
    assert mgr.num_free_blocks == 199
    # Prefix caching off: no checkpoint pages at all.
    mgr = manager(_mamba_plan(mamba_checkpoint_interval=16), 200, caching=False)
    new, _ = admit(mgr, Request("a", system))
    assert sum(1 for b in new[1] if b) == 1


@pytest.mark.parametrize("config, block_size", [("qwen3-next-80b-a3b", 96), ("qwen3.6-27b", 64)])
def test_deltanet_hybrid_hits_a_short_shared_prefix_that_vllms_layout_misses(config, block_size):
    """Gated DeltaNet hybrids: a state spread over 11 or 13 pages keeps the block at 96 or 64
    tokens; vLLM's layout (one page per state) makes it 1056 or 784, larger than the prompts."""
    from distengine.model_config import load_config_dict, parse_model_config
    from distengine.kv_cache.plan import make_plan, vllm_plan
    name, cfg = load_config_dict(config)
    plan = make_plan(parse_model_config(cfg, name))
    vllm = vllm_plan(plan)
    assert plan.block_size == block_size and 3 * plan.block_size <= vllm.block_size
    assert plan.mamba_group_ids
    shared = list(range(96))
    for p in (plan, vllm):
        mgr = manager(p, 400)
        a = Request("a", shared + [1] * 4)
        admit(mgr, a)
        decode(mgr, a)
        mgr.free(a)
        b = Request("b", shared + [2] * 4)
        blocks, hit = mgr.get_computed_blocks(b)
        if p is vllm:
            assert hit == 0 and not any(blocks)
            continue
        bs = p.block_size
        # The whole shared prefix in whole blocks, restored from the state kept at its end (the
        # last block end of a's prompt step).
        assert hit == 96 // bs * bs > 0
        for g in p.groups:
            table = blocks[g.group_id]
            assert len(table) == hit // bs
            if g.spec.kind == MAMBA:
                assert all(x is mgr.pool.null_block for x in table[:-1])
                assert table[-1] is mgr.pool.cached[g.group_id][b.block_hashes[hit // bs - 1]]
            else:
                assert all(x is not mgr.pool.null_block for x in table)
        assert mgr.allocate_slots(b, b.num_tokens - hit, hit, blocks) is not None
        mgr.free(b)
        assert mgr.num_free_blocks == 399


def test_cross_attention_allocated_once_never_cached():
    plan = plan_of((FULL, 1), (CROSS, 1), group_size=1, block_size=4)
    mgr = manager(plan, 50)
    a = Request("a", list(range(9)), num_encoder_tokens=10)
    new, _ = admit(mgr, a)
    assert len(new[1]) == 3
    for _ in range(8):
        decode(mgr, a)
    assert held(mgr, "a") == [5, 3]
    mgr.free(a)
    assert all(not table for table in mgr.pool.cached[1:])


def test_reset_prefix_cache_refused_while_in_use():
    mgr = manager(plan_of((FULL, 1)), 20)
    a = Request("a", list(range(40)))
    admit(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    _, hit = mgr.get_computed_blocks(Request("b", list(range(40))))
    assert hit == 0


def test_no_prefix_caching_path():
    mgr = manager(plan_of((FULL, 1), (SLIDING, 1), group_size=1, window=8), 50, caching=False)
    a = Request("a", list(range(40)))
    admit(mgr, a)
    mgr.free(a)
    blocks, hit = mgr.get_computed_blocks(Request("b", list(range(40))))
    assert hit == 0 and not any(blocks)
    assert all(not t for t in mgr.pool.cached)
    assert mgr.num_free_blocks == 49


def test_bad_input_raises_clearly():
    mgr = manager(plan_of((FULL, 1), max_len=64), 50)
    with pytest.raises(ValueError, match="max_model_len"):
        mgr.allocate_slots(Request("a", list(range(65))), 65)
    with pytest.raises(ValueError, match="negative"):
        mgr.allocate_slots(Request("b", [1, 2]), -1)
    with pytest.raises(ValueError, match="has 2"):
        mgr.allocate_slots(Request("c", [1, 2]), 3)
    assert mgr.num_free_blocks == 49


def test_usage_and_decode_fast_path_agree_with_slow_path():
    plan = _sliding_groups_model()
    mgr = manager(plan, 300)
    a = Request("a", list(range(10)))
    admit(mgr, a)
    appended = []
    for t in range(60):
        new = decode(mgr, a, t)
        appended.append(sum(len(x) for x in new))
    # Every block boundary appends one entry per group (3 groups), nothing in between.
    assert sum(appended) == 3 * (70 // 4 + 1 - 3)
    # 70 tokens; the last allocation was for position 69, which reads 62..69: blocks 15-17.
    assert held(mgr, "a") == [18, 3, 3]
    assert 0 < mgr.usage < 1


def test_fresh_blocks_are_used_before_any_cached_block_is_evicted():
    plan = _sliding_groups_model()
    mgr = manager(plan, 400)
    a = Request("a", list(range(40)))
    admit(mgr, a)
    mgr.allocate_slots(a, 0)  # a's out-of-window blocks: free, cached, in the evict-first band
    skipped = [b for b in mgr.pool.free_queue if b.block_hash is not None]
    assert skipped
    admit(mgr, Request("b", [999] * 40))  # plenty of never-used blocks left
    assert all(b.block_hash is not None for b in skipped)
    _, hit = mgr.get_computed_blocks(Request("c", list(range(40)) + [1]))
    assert hit == 40
