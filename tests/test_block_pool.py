"""The block pool creates its blocks lazily: same ids, same eviction order, same counts as a pool
whose blocks all exist up front (modelled here with plain lists), and no cost for a huge pool."""
from __future__ import annotations

import random
import time

import pytest

from distengine.kv_cache.block_pool import EVICT_FIRST, NORMAL, BlockPool
from tests.helpers import free_ids


class EagerPool:
    """What the pool does when every block exists from the start, by block id. The free queue pops
    unhashed freed blocks (most recently freed first), then never-used blocks by id, then the
    evict-first band, then the normal band (each least recently freed first)."""

    def __init__(self, num_blocks: int, num_groups: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.hash: list[tuple[int, int] | None] = [None] * num_blocks  # (group, hash)
        self.cached: list[dict[int, int]] = [{} for _ in range(num_groups)]
        self.unhashed: list[int] = []  # front first
        self.never_used = list(range(1, num_blocks))
        self.bands: tuple[list[int], list[int]] = ([], [])

    def order(self) -> list[int]:
        return self.unhashed + self.never_used + self.bands[EVICT_FIRST] + self.bands[NORMAL]

    def _remove(self, bid: int) -> None:
        for part in (self.unhashed, self.never_used, *self.bands):
            if bid in part:
                part.remove(bid)
                return
        raise AssertionError(f"block {bid} is not free")

    @property
    def num_free_blocks(self) -> int:
        return len(self.order())

    def get_new_blocks(self, n: int) -> list[int]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot get {n} blocks: {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            bid = self.order()[0]
            self._remove(bid)
            if self.hash[bid] is not None:
                g, h = self.hash[bid]
                del self.cached[g][h]
                self.hash[bid] = None
            self.ref[bid] = 1
            out.append(bid)
        return out

    def touch(self, ids: list[int]) -> None:
        for bid in ids:
            if bid:
                if self.ref[bid] == 0:
                    self._remove(bid)
                self.ref[bid] += 1

    def free_blocks(self, ids: list[int], band: int) -> None:
        for bid in ids:
            if bid:
                self.ref[bid] -= 1
                if self.ref[bid] == 0:
                    if self.hash[bid] is None:
                        self.unhashed.insert(0, bid)
                    else:
                        self.bands[band].append(bid)

    def cache_block(self, bid: int, h: int, group: int) -> None:
        if bid and self.hash[bid] is None and h not in self.cached[group]:
            self.cached[group][h] = bid
            self.hash[bid] = (group, h)

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for table in self.cached:
            table.clear()
        self.hash = [None] * self.num_blocks
        return True


def _check_same(pool: BlockPool, ref: EagerPool) -> None:
    assert free_ids(pool.free_queue) == ref.order()
    assert pool.num_free_blocks == ref.num_free_blocks and pool.usage == pytest.approx(
        1 - ref.num_free_blocks / (ref.num_blocks - 1))
    for block in pool.free_queue.created:
        bid = block.block_id
        assert block.ref_cnt == ref.ref[bid]
        assert (None if block.block_hash is None else (block.group_id, block.block_hash)) == ref.hash[bid]
    for g, table in enumerate(pool.cached):
        assert {h: b.block_id for h, b in table.items()} == ref.cached[g]


@pytest.mark.parametrize("seed", range(30))
def test_lazy_pool_matches_the_eager_model(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([2, 3, 8, 20, 60])
    pool, ref = BlockPool(num_blocks, 2), EagerPool(num_blocks, 2)
    held: list[int] = []  # one entry per reference taken (touches repeat ids)
    for _ in range(300):
        op = rng.choice(["get", "get", "free", "free", "touch", "cache", "cache_any", "look_up", "reset"])
        if op == "get":
            n = rng.randint(1, 6)
            try:
                expected = ref.get_new_blocks(n)
            except ValueError as e:
                with pytest.raises(ValueError) as got:
                    pool.get_new_blocks(n)
                assert str(got.value) == str(e)
            else:
                assert [b.block_id for b in pool.get_new_blocks(n)] == expected
                held += expected
        elif op == "free" and held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            ids, held = held[:k] + [0] * rng.randint(0, 1), held[k:]  # 0: the null block, passed over
            band = rng.choice([EVICT_FIRST, NORMAL])
            pool.free_blocks([pool.blocks[i] for i in ids], band)
            ref.free_blocks(ids, band)
        elif op == "touch":  # a prefix hit: cached blocks, free or in use
            ids = [b for g in range(2) for b in ref.cached[g].values()]
            ids = rng.sample(ids, min(len(ids), rng.randint(0, 3))) + [0] * rng.randint(0, 1)
            pool.touch([pool.blocks[i] for i in ids])
            ref.touch(ids)
            held += [i for i in ids if i]
        elif op == "cache" and held:  # what a manager does: blocks it holds
            ids = rng.sample(held, rng.randint(1, min(3, len(held))))
            g, hashes = rng.randrange(2), [rng.randrange(12) for _ in ids]
            pool.cache_blocks(g, [pool.blocks[i] for i in ids], hashes, 0, len(ids))
            for i, h in zip(ids, hashes):
                ref.cache_block(i, h, g)
        elif op == "cache_any":  # what tests do: any block, a never-used one included
            i, g, h = rng.randrange(num_blocks), rng.randrange(2), rng.randrange(12)
            pool.cache_block(pool.blocks[i], h, g)
            ref.cache_block(i, h, g)
        elif op == "look_up":
            i = rng.randrange(-num_blocks, num_blocks)
            assert pool.blocks[i].block_id == i % num_blocks
        elif op == "reset":
            assert pool.reset_prefix_cache() == ref.reset_prefix_cache()
        _check_same(pool, ref)
    # Iterating creates every block, in pop order.
    assert [b.block_id for b in pool.free_queue] == ref.order()
    assert len(pool.free_queue.created) == num_blocks and pool.free_queue.fresh.prev is None
    assert [b.block_id for b in pool.blocks] == list(range(num_blocks))
    _check_same(pool, ref)


def test_a_huge_pool_is_cheap_to_build_and_use():
    start = time.perf_counter()
    pool = BlockPool(100_000_000, 2)
    assert time.perf_counter() - start < 5  # ~70 s when every block was built up front
    queue = pool.free_queue
    assert len(queue.created) == 1 and pool.blocks[0] is pool.null_block
    assert len(pool.blocks) == 100_000_000
    assert pool.num_free_blocks == 100_000_000 - 1 and pool.usage == 0
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3] and all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 100_000_000 - 4
    pool.cache_block(blocks[0], 11, 0)
    pool.free_blocks(blocks, NORMAL)  # 2 and 3 unhashed: reused first, 3 on top; 1 cached: last
    assert pool.num_free_blocks == 100_000_000 - 1
    assert [b.block_id for b in pool.get_new_blocks(4)] == [3, 2, 4, 5]
    assert pool.get_cached_blocks(11, [0]) == [blocks[0]]
    assert len(queue.created) == 6  # blocks 0-5: nothing else was built
    with pytest.raises(ValueError, match=r"cannot get 100000000 blocks: 99999995 free"):
        pool.get_new_blocks(100_000_000)
    assert pool.reset_prefix_cache() is False
    assert len(queue.created) == 6


def test_a_looked_up_never_used_block_keeps_its_place():
    pool, ref = BlockPool(10, 1), EagerPool(10, 1)
    block = pool.blocks[5]  # creates blocks 1-5, linked where they already were
    assert block.block_id == 5 and pool.free_queue.fresh_start == 6
    pool.cache_block(block, 42, 0)
    ref.cache_block(5, 42, 0)
    _check_same(pool, ref)
    assert pool.get_cached_blocks(42, [0]) == [block]
    got = [b.block_id for b in pool.get_new_blocks(7)]
    assert got == ref.get_new_blocks(7) == [1, 2, 3, 4, 5, 6, 7]
    assert pool.get_cached_blocks(42, [0]) is None and block.block_hash is None  # evicted in turn
    _check_same(pool, ref)
    # A prefix hit on a looked-up block still free: it leaves the queue from the middle.
    pool2, ref2 = BlockPool(10, 1), EagerPool(10, 1)
    pool2.cache_block(pool2.blocks[3], 7, 0)
    ref2.cache_block(3, 7, 0)
    pool2.touch([pool2.blocks[3]])
    ref2.touch([3])
    _check_same(pool2, ref2)
    assert [b.block_id for b in pool2.get_new_blocks(3)] == ref2.get_new_blocks(3) == [1, 2, 4]
    pool2.free_blocks([pool2.blocks[3]], EVICT_FIRST)
    ref2.free_blocks([3], EVICT_FIRST)
    assert [b.block_id for b in pool2.get_new_blocks(6)] == ref2.get_new_blocks(6) == [5, 6, 7, 8, 9, 3]
    _check_same(pool2, ref2)


def test_the_sentinel_goes_when_the_never_used_blocks_run_out():
    pool = BlockPool(4, 1)
    queue = pool.free_queue
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert queue.fresh.prev is None and queue.head.next is queue.mid and queue.mid.next is queue.tail
    with pytest.raises(ValueError, match="cannot get 1 blocks: 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.blocks[2], pool.blocks[1]], EVICT_FIRST)
    assert [b.block_id for b in queue] == [1, 2] and pool.usage == pytest.approx(1 / 3)
    # Looking blocks up once all exist creates nothing more.
    assert pool.blocks[-1].block_id == 3 and len(queue.created) == 4
    assert pool.blocks[1:3] == [pool.blocks[1], pool.blocks[2]]
    with pytest.raises(IndexError):
        pool.blocks[4]
