"""One pool of equal-size blocks shared by every KV cache group.

Block 0 is the null block: it stands in block tables for positions a layer no longer reads
(out of a sliding window, before a local chunk, an old Mamba state) and is never allocated.

Free blocks wait in one queue, least recently freed first, split in two bands: blocks a manager
marks as unlikely to be hit again (sliding-window blocks from the middle of a request) are evicted
before everything else. A freed block keeps its hash, and so stays findable by a prefix-cache
lookup, until it is popped for reuse.

Blocks are created on first use (see FreeBlockQueue), so a pool of millions costs nothing up front.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import overload


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.group_id = -1
        self.prev: KVCacheBlock | None = None
        self.next: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


# Eviction bands, popped in this order.
EVICT_FIRST = 0
NORMAL = 1


class FreeBlockQueue:
    """Doubly linked list: head | unhashed | fresh | band EVICT_FIRST | mid | band NORMAL | tail.

    `popleft` takes the front: unhashed freed blocks (most recently freed first: `appendleft`),
    then never-used blocks by id, then the evict-first band, then normal blocks (each band least
    recently freed first); `remove` takes a block out of the middle in O(1) when a prefix hit
    reuses it.

    Blocks are created lazily: a pool can hold ~100 million of them (a tiny model on a large GPU),
    too many Python objects to build up front. The never-used ("fresh") blocks are always the id
    range [fresh_start, num_blocks), in id order, between the unhashed blocks and the evict-first
    band: `appendleft` inserts before them, `append` after them, and `remove` only sees blocks
    handed out before. So the sentinel `fresh` stands for the whole range, and is unlinked for
    good once the range is used up. `created` holds every block created so far, by id.
    """

    def __init__(self, created: list[KVCacheBlock], num_blocks: int) -> None:
        # `created`: the blocks that exist already, ids 0.., none of them free; the rest are fresh.
        self.created, self.num_blocks = created, num_blocks
        self.head, self.fresh = KVCacheBlock(-1), KVCacheBlock(-4)
        self.mid, self.tail = KVCacheBlock(-2), KVCacheBlock(-3)
        self.head.next, self.fresh.prev = self.fresh, self.head
        self.fresh.next, self.mid.prev = self.mid, self.fresh
        self.mid.next, self.tail.prev = self.tail, self.mid
        self._band_end = (self.mid, self.tail)
        self.num_free_blocks = num_blocks - len(created)
        if not self.num_free_blocks:
            self._unlink_fresh()

    @property
    def fresh_start(self) -> int:
        """The first never-used block id: blocks below it exist, blocks from it on do not yet."""
        return len(self.created)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next
        if block is self.fresh:
            # The next never-used block, created now, never linked. Inline rather than a method:
            # with a huge pool nearly every pop takes this path.
            created = self.created
            block = KVCacheBlock(len(created))
            created.append(block)
            self.num_free_blocks -= 1
            if len(created) == self.num_blocks:
                self._unlink_fresh()
            return block
        if block is self.mid:
            block = block.next
        if block is self.tail:
            raise ValueError("no free blocks left")
        # remove(block), inline: the call saved per block pays for the `fresh` check above.
        prev, nxt = block.prev, block.next
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.num_free_blocks -= 1
        return block

    def materialise(self, block_id: int) -> None:
        """Create the fresh blocks up to `block_id` and link them where they would be had they
        existed from the start: just before `fresh`, in id order, after any created earlier and
        still free. They stay free: the count is unchanged."""
        created, fresh = self.created, self.fresh
        if block_id < len(created):
            return
        for i in range(len(created), block_id + 1):
            block = KVCacheBlock(i)
            prev = fresh.prev
            prev.next, block.prev, block.next, fresh.prev = block, prev, fresh, block
            created.append(block)
        if len(created) == self.num_blocks:
            self._unlink_fresh()

    def _unlink_fresh(self) -> None:
        fresh = self.fresh
        fresh.prev.next, fresh.next.prev = fresh.next, fresh.prev
        fresh.prev = fresh.next = None

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev, block.next
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock, band: int) -> None:
        end = self._band_end[band]
        prev = end.prev
        prev.next, block.prev, block.next, end.prev = block, prev, end, block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        nxt = self.head.next
        self.head.next, block.prev, block.next, nxt.prev = block, self.head, nxt, block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Every free block in pop order. Fresh blocks are created (see `materialise`) one by one
        as the walk reaches them, so walking to the end creates the whole pool: for tests and
        debugging, not for a pool of millions of blocks."""
        block = self.head.next
        while block is not self.tail:
            if block is self.fresh:
                self.materialise(len(self.created))
                block = self.created[-1]
            if block is not self.mid:
                yield block
            block = block.next


class PoolBlocks(Sequence[KVCacheBlock]):
    """`pool.blocks`: the pool's blocks indexed by id, read-only. Block i is created on first
    access, with every fresh block before it (`FreeBlockQueue.materialise` keeps the queue order
    exact). Iterating, or slicing to the end, creates every block: for tests and debugging; the
    engine itself only touches blocks it was handed."""

    __slots__ = ("_queue",)

    def __init__(self, queue: FreeBlockQueue) -> None:
        self._queue = queue

    def __len__(self) -> int:
        return self._queue.num_blocks

    @overload
    def __getitem__(self, index: int) -> KVCacheBlock: ...

    @overload
    def __getitem__(self, index: slice) -> list[KVCacheBlock]: ...

    def __getitem__(self, index):
        queue, created = self._queue, self._queue.created
        if isinstance(index, slice):
            ids = range(*index.indices(queue.num_blocks))
            if ids:
                queue.materialise(max(ids))
            return [created[i] for i in ids]
        i = operator.index(index)
        if i < 0:
            i += queue.num_blocks
        if not 0 <= i < queue.num_blocks:
            raise IndexError(f"block {index} out of range: the pool has {queue.num_blocks}")
        if i >= len(created):
            queue.materialise(i)
        return created[i]

    def __iter__(self) -> Iterator[KVCacheBlock]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"PoolBlocks({self._queue.num_blocks} blocks, {self._queue.fresh_start} created)"


class BlockPool:
    def __init__(self, num_blocks: int, num_groups: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.null_block = KVCacheBlock(0)
        # Every other block is created when first popped or looked up (see FreeBlockQueue).
        self.free_queue = FreeBlockQueue([self.null_block], num_blocks)
        self.blocks = PoolBlocks(self.free_queue)
        # Per group: block hash -> the block that holds it.
        self.cached: list[dict[int, KVCacheBlock]] = [{} for _ in range(num_groups)]

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free_blocks / (self.num_blocks - 1)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop blocks for exclusive use (ref count 1), evicting the cached ones taken."""
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} blocks: {self.free_queue.num_free_blocks} free")
        popleft, cached = self.free_queue.popleft, self.cached
        out = []
        for _ in range(num_blocks):
            block = popleft()
            if block.block_hash is not None:
                del cached[block.group_id][block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to prefix-hit blocks, pulling free ones out of the queue."""
        null, remove = self.null_block, self.free_queue.remove
        for block in blocks:
            if block is null:
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock], band: int = NORMAL) -> None:
        """Drop one reference each; blocks reaching zero join the queue in the order given."""
        null, queue = self.null_block, self.free_queue
        for block in blocks:
            if block is null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    queue.appendleft(block)
                else:
                    queue.append(block, band)

    def cache_blocks(self, group_id: int, table: list[KVCacheBlock], block_hashes: Sequence[int],
                     start: int, stop: int) -> None:
        """Register table[i] under block_hashes[i] for i in [start, stop); null entries and
        blocks registered already are passed over."""
        by_hash, null = self.cached[group_id], self.null_block
        for i in range(start, stop):
            block = table[i]
            if block is not null and block.block_hash is None:
                h = block_hashes[i]
                # Two requests can compute the same block concurrently: the first stays cached,
                # the other is simply not findable (and recycled first when freed).
                if h not in by_hash:
                    by_hash[h] = block
                    block.block_hash, block.group_id = h, group_id

    def cache_block(self, block: KVCacheBlock, block_hash: int, group_id: int) -> None:
        self.cache_blocks(group_id, [block], [block_hash], 0, 1)

    def get_cached_blocks(self, block_hash: int, group_ids: list[int]) -> list[KVCacheBlock] | None:
        out = []
        for g in group_ids:
            block = self.cached[g].get(block_hash)
            if block is None:
                return None
            out.append(block)
        return out

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.free_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for table in self.cached:
            table.clear()
        # Only created blocks can hold a hash: the fresh ones are left uncreated.
        for block in self.free_queue.created:
            block.block_hash = None
            block.group_id = -1
        return True
