"""One pool of equal-size blocks shared by every KV cache group.

Block 0 is the null block: it stands in block tables for positions a layer no longer reads
(out of a sliding window, before a local chunk, an old Mamba state) and is never allocated.

Free blocks wait in one queue, least recently freed first, split in two bands: blocks a manager
marks as unlikely to be hit again (sliding-window blocks from the middle of a request) are evicted
before everything else. A freed block keeps its hash, and so stays findable by a prefix-cache
lookup, until it is popped for reuse.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


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
    """Doubly linked list: head | band EVICT_FIRST | mid | band NORMAL | tail.

    `popleft` takes the front (unhashed blocks, then the evict-first band, then normal blocks,
    each least recently freed first); `remove` takes a block out of the middle in O(1) when a
    prefix hit reuses it.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.head, self.mid, self.tail = KVCacheBlock(-1), KVCacheBlock(-2), KVCacheBlock(-3)
        self.head.next, self.mid.prev = self.mid, self.head
        self.mid.next, self.tail.prev = self.tail, self.mid
        self._band_end = (self.mid, self.tail)
        self.num_free_blocks = 0
        # Never-used blocks go first, ahead of every block that still holds a cached hash.
        for block in blocks:
            self.append(block, EVICT_FIRST)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next
        if block is self.mid:
            block = block.next
        if block is self.tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

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

    def __iter__(self):
        block = self.head.next
        while block is not self.tail:
            if block is not self.mid:
                yield block
            block = block.next


class BlockPool:
    def __init__(self, num_blocks: int, num_groups: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
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
        for block in self.blocks:
            block.block_hash = None
            block.group_id = -1
        return True
