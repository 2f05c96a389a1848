"""One manager per attention type; each serves every KV cache group that shares its spec.

Groups with the same spec always hold the same number of blocks for a request (they see the same
tokens), so a manager decides once per request and applies the decision to all its groups: a
prefix lookup is one scan in which a block hash must be cached in every group, and an allocation
pops `n x groups` blocks at once.

A request's table in a group has one entry per block of its tokens; entries the layer no longer
reads are the null block.
"""
from __future__ import annotations

from collections.abc import Sequence

from distengine.request import Request
from distengine.kv_cache.block_pool import EVICT_FIRST, NORMAL, BlockPool, KVCacheBlock
from distengine.kv_cache.specs import (ChunkedLocalAttentionSpec, CrossAttentionSpec, FullAttentionSpec,
                                       KVCacheSpec, MambaSpec, SlidingWindowSpec, cdiv)

GroupBlocks = list[list[KVCacheBlock]]  # one list per group of the manager


class RequestBlocks:
    """A request's tables in the groups of one manager."""

    __slots__ = ("tables", "num_cached", "num_skipped", "hit_lo", "hit_hi")

    def __init__(self, num_groups: int) -> None:
        self.tables: GroupBlocks = [[] for _ in range(num_groups)]
        self.num_cached = 0  # leading blocks whose hashes are registered (or were checked)
        self.num_skipped = 0  # leading entries already replaced by the null block
        # Block range that came from a prefix hit: for windowed types, the blocks that end a
        # shared prompt; they are freed into the normal band, not the evict-first one.
        self.hit_lo = self.hit_hi = 0


class SingleTypeKVCacheManager:
    spec: KVCacheSpec
    # Whether full blocks are registered when allocated (before the step computes them). Safe
    # for attention: each layer stores the whole batch's K/V before any request reads them, so a
    # hit in the same step reads written data. Not safe for a recurrent state (see Mamba).
    cache_ahead = True
    # The band of blocks dropped mid-request (out of the window): unlikely to be hit again.
    skip_band = EVICT_FIRST

    def __init__(self, spec: KVCacheSpec, group_ids: list[int], pool: BlockPool) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.group_ids = group_ids
        self.num_groups = len(group_ids)
        self.pool = pool
        self.null_block = pool.null_block
        self.requests: dict[str, RequestBlocks] = {}

    # ---- prefix lookup -------------------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: Sequence[int], max_length: int) -> tuple[GroupBlocks, int]:
        """Blocks per group of the longest prefix of at most `max_length` tokens that hits."""
        raise NotImplementedError

    def _lookup(self, block_hash: int) -> list[KVCacheBlock] | None:
        return self.pool.get_cached_blocks(block_hash, self.group_ids)

    # ---- allocation ----------------------------------------------------------------------
    def _needed_indices(self, request: Request, num_computed: int, num_tokens: int,
                        num_entries: int) -> range | list[int]:
        """Block indices, at or after `num_entries`, that need a new block for tokens up to num_tokens."""
        return range(max(num_entries, self.spec.first_needed_block(num_computed)), cdiv(num_tokens, self.block_size))

    def num_blocks_to_allocate(self, request: Request, num_computed: int, num_tokens: int,
                               new_computed: GroupBlocks | None) -> int:
        """Net blocks taken from the free pool by an allocation: new ones, plus prefix-hit blocks
        that are free now, minus the blocks that skipping out-of-window entries will free."""
        req = self.requests.get(request.request_id)
        num_entries = len(req.tables[0]) if req is not None else 0
        net = 0
        if new_computed:
            num_entries += len(new_computed[0])
            net += sum(1 for blocks in new_computed for b in blocks if b.ref_cnt == 0 and b is not self.null_block)
        net += len(self._needed_indices(request, num_computed, num_tokens, num_entries)) * self.num_groups
        if req is not None and self.spec.first_needed_block(num_computed) > req.num_skipped:
            stop = self.spec.first_needed_block(num_computed)
            net -= sum(1 for t in req.tables for b in t[req.num_skipped:stop]
                       if b.ref_cnt == 1 and b is not self.null_block)
        return net

    def take_hits_and_skip(self, request: Request, num_computed: int, new_computed: GroupBlocks | None) -> None:
        """Allocation, first phase (pops no block): take the prefix-hit blocks, free the blocks
        no longer read. The coordinator runs it for every manager before any `allocate_new`: a
        block popped for one group must not be a free prefix-hit block of another group, nor be
        counted on before another group frees its skipped blocks."""
        req = self.requests.get(request.request_id)
        if req is None:
            req = self.requests[request.request_id] = RequestBlocks(self.num_groups)
            if new_computed and new_computed[0]:
                self._save_hit(req, new_computed)
        elif new_computed and new_computed[0]:
            raise ValueError(f"request {request.request_id}: prefix-hit blocks are only taken at admission")
        self._skip(req, num_computed)

    def allocate_new(self, request: Request, num_computed: int, num_tokens: int) -> list[list[int]] | None:
        """Allocation, second phase: pop and append the new blocks; returns the entries appended
        to each group's table (block ids, null = 0), or None when nothing was appended."""
        return self._append_new(request, self.requests[request.request_id], num_computed, num_tokens)

    def _save_hit(self, req: RequestBlocks, new_computed: GroupBlocks) -> None:
        null = self.null_block
        for table, blocks in zip(req.tables, new_computed):
            table.extend(blocks)
            self.pool.touch(blocks)
        first = req.tables[0]
        lo = 0
        while lo < len(first) and first[lo] is null:
            lo += 1
        req.num_skipped, req.hit_lo, req.hit_hi = lo, lo, len(first)
        # Hit blocks are registered already.
        req.num_cached = len(first)

    def _skip(self, req: RequestBlocks, num_computed: int) -> None:
        stop = self.spec.first_needed_block(num_computed)
        start = req.num_skipped
        if stop <= start:
            return
        null, free = self.null_block, self.pool.free_blocks
        lo, hi = max(start, req.hit_lo), min(stop, req.hit_hi)
        for table in req.tables:
            end = min(stop, len(table))
            dropped = table[start:end]
            table[start:end] = [null] * len(dropped)
            if lo < hi:
                free([b for i, b in enumerate(dropped, start) if not lo <= i < hi], self.skip_band)
                free(dropped[lo - start:hi - start], NORMAL)
            else:
                free(dropped, self.skip_band)
        req.num_skipped = stop

    def _append_new(self, request: Request, req: RequestBlocks, num_computed: int,
                    num_tokens: int) -> list[list[int]] | None:
        tables = req.tables
        num_entries = len(tables[0])
        needed = self._needed_indices(request, num_computed, num_tokens, num_entries)
        if not needed:
            return None
        n = len(needed)
        new = self.pool.get_new_blocks(n * self.num_groups)
        null = self.null_block
        appended = []
        for j, table in enumerate(tables):
            blocks = new[j * n:(j + 1) * n]
            if needed[0] > num_entries or needed[-1] - needed[0] + 1 != n:
                # Gaps (null entries) before or between the new blocks.
                row = [null] * (needed[-1] + 1 - num_entries)
                for i, b in zip(needed, blocks):
                    row[i - num_entries] = b
                blocks = row
            table.extend(blocks)
            appended.append([b.block_id for b in blocks])
        return appended

    # ---- caching and freeing -------------------------------------------------------------
    def cache_blocks(self, request_id: str, block_hashes: Sequence[int], num_tokens: int) -> None:
        """Register the hashes of the full blocks among the first `num_tokens` tokens."""
        req = self.requests.get(request_id)
        if req is None:
            return
        num_full = num_tokens // self.block_size
        start = req.num_cached
        if num_full <= start:
            return
        for g, table in zip(self.group_ids, req.tables):
            self.pool.cache_blocks(g, table, block_hashes, start, min(num_full, len(table)))
        req.num_cached = num_full

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first so that its tail is evicted first."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for table in req.tables:
            self.pool.free_blocks(reversed(table), NORMAL)

    def quiet_limits(self, request_id: str) -> tuple[float, float]:
        """(num_tokens, num_computed) bounds within which an allocation for this request may do
        nothing here.

        Only a new block is never deferred. Dropping blocks that left the window and
        registering a block that just became full wait for the next block boundary (at most a
        block late, and `free` registers what is left): one slow allocation per block of
        decoding instead of two or three.
        """
        req = self.requests[request_id]
        bs = self.block_size
        computed = self.spec.next_skip_at(req.num_skipped) - 1
        if self.pool.enable_caching and self.spec.cacheable:
            computed = min(computed, (req.num_cached + 1) * bs - 1)
        return len(req.tables[0]) * bs, computed + bs - 1

    def block_ids(self, request_id: str) -> list[list[int]]:
        req = self.requests.get(request_id)
        if req is None:
            return [[] for _ in range(self.num_groups)]
        return [[b.block_id for b in t] for t in req.tables]


class FullAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, block_hashes, max_length):
        num = min(len(block_hashes), max_length // self.block_size)
        hits: GroupBlocks = [[] for _ in self.group_ids]
        if self.num_groups == 1:
            get, row = self.pool.cached[self.group_ids[0]].get, hits[0]
            for h in block_hashes[:num]:
                block = get(h)
                if block is None:
                    break
                row.append(block)
        else:
            for h in block_hashes[:num]:
                blocks = self._lookup(h)
                if blocks is None:
                    break
                for row, block in zip(hits, blocks):
                    row.append(block)
        return hits, len(hits[0]) * self.block_size


class SlidingWindowManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, block_hashes, max_length):
        """Scan from the right for a run of cached blocks covering window-1 tokens; the blocks
        before the run are never read, so they need not be cached (null entries)."""
        bs, null = self.block_size, self.null_block
        num = min(len(block_hashes), max_length // bs)
        need = cdiv(self.spec.window - 1, bs)
        hits: GroupBlocks = [[null] * num for _ in self.group_ids]
        run, end = 0, None
        for i in range(num - 1, -1, -1):
            if run >= need:
                end = i + 1 + run
                break
            blocks = self._lookup(block_hashes[i])
            if blocks is None:
                run = 0
                continue
            for row, block in zip(hits, blocks):
                row[i] = block
            run += 1
        if end is None:
            # Either a full run was found ending at index 0, or only the blocks from the start
            # are cached: both are hits of `run` blocks.
            end = run
        for row in hits:
            del row[end:]
        return hits, end * bs


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    def find_longest_cache_hit(self, block_hashes, max_length):
        """Blocks before the chunk that holds position max_length are never read again: only
        the current chunk's blocks must be cached, scanned from its start."""
        bs, null = self.block_size, self.null_block
        num = min(len(block_hashes), max_length // bs)
        start = min(num, (max_length // self.spec.chunk) * self.spec.chunk // bs)
        hits: GroupBlocks = [[null] * start for _ in self.group_ids]
        for i in range(start, num):
            blocks = self._lookup(block_hashes[i])
            if blocks is None:
                break
            for row, block in zip(hits, blocks):
                row.append(block)
        return hits, len(hits[0]) * bs


class MambaManager(SingleTypeKVCacheManager):
    """One state page set per table entry that holds a state: the running one, and checkpoints.

    The worker's rule for a step computing tokens [T, N) (`workers.mamba_metadata`): read the
    state from entry (T-1)//B (zeros when T = 0); write the state after token N-1 to entry
    (N-1)//B; and write the state at the end of every block that ends inside the step to that
    block's entry when it is not null. So every non-null entry of a block that ended by
    num_computed holds the state at its end, and is registered under the block's hash once
    computed; a prefix hit restores it.

    Which block ends get a checkpoint (a page) is decided here, with prefix caching on: the
    last block end of each step (the next chunk, a later turn of the conversation), every
    `checkpoint_interval` tokens, and the end of the longest prefix the request shares with
    cached full-attention blocks when the state there is not cached: where two prompts
    diverge, so that the next request sharing that prefix hits all of it.
    """

    cache_ahead = False  # a state is written at the end of the layer's scan, not before
    skip_band = NORMAL  # a dropped entry is a checkpoint: as likely to be hit as attention blocks

    def __init__(self, spec: KVCacheSpec, group_ids: list[int], pool: BlockPool) -> None:
        super().__init__(spec, group_ids, pool)
        self.prefix_group: int | None = None  # a full-attention group (set by the coordinator)
        self.diverge: dict[str, int] = {}  # request id -> token count to checkpoint at
        # Set by the coordinator for an allocation the pool cannot serve with checkpoints: they
        # only serve later prefix hits, so they give way to the request's own pages.
        self.lean = False

    def _needed_indices(self, request, num_computed, num_tokens, num_entries):
        bs = self.block_size
        out = []
        if self.pool.enable_caching and not self.lean:
            every = self.spec.checkpoint_interval
            rid = request.request_id
            diverge = self.diverge.get(rid, 0) if rid in self.requests else self._divergence(request, num_computed)
            last_end = num_tokens // bs * bs
            for end in range((num_computed // bs + 1) * bs, num_tokens, bs):  # block ends inside the step
                if end == last_end or end == diverge or (every and end % every == 0):
                    out.append(end // bs - 1)
        out.append((num_tokens - 1) // bs)
        return [i for i in out if i >= num_entries]

    def take_hits_and_skip(self, request, num_computed, new_computed):
        if request.request_id not in self.requests and self.pool.enable_caching:
            d = self._divergence(request, num_computed)
            if d:
                self.diverge[request.request_id] = d
        super().take_hits_and_skip(request, num_computed, new_computed)

    def _divergence(self, request: Request, num_computed: int) -> int:
        """At admission: the end of the prompt's prefix cached in full-attention blocks, when it
        lies beyond the hit (0: none)."""
        if self.prefix_group is None:
            return 0
        cached = self.pool.cached[self.prefix_group]
        hashes = request.block_hashes
        n = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        i = num_computed // self.block_size
        while i < n and hashes[i] in cached:
            i += 1
        return i * self.block_size if i * self.block_size > num_computed else 0

    def free(self, request_id: str) -> None:
        self.diverge.pop(request_id, None)
        super().free(request_id)

    def quiet_limits(self, request_id: str) -> tuple[float, float]:
        # A page the request no longer reads is a whole state per layer: dropped (and cached) at
        # the first allocation after it, not up to a block late as attention blocks are.
        req = self.requests[request_id]
        bs = self.block_size
        computed = self.spec.next_skip_at(req.num_skipped) - 1
        if self.pool.enable_caching:
            computed = min(computed, (req.num_cached + 2) * bs - 2)
        return len(req.tables[0]) * bs, computed

    def find_longest_cache_hit(self, block_hashes, max_length):
        num = min(len(block_hashes), max_length // self.block_size)
        for i in range(num - 1, -1, -1):
            blocks = self._lookup(block_hashes[i])
            if blocks is not None:
                return [[self.null_block] * i + [b] for b in blocks], (i + 1) * self.block_size
        return [[] for _ in self.group_ids], 0


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Encoder K/V: allocated in full at a request's first allocation, never cached."""

    def find_longest_cache_hit(self, block_hashes, max_length):
        raise RuntimeError("cross-attention blocks are not prefix-cached")

    def _needed_indices(self, request, num_computed, num_tokens, num_entries):
        return range(num_entries, cdiv(request.num_encoder_tokens, self.block_size))

    def cache_blocks(self, request_id, block_hashes, num_tokens):
        return

    def quiet_limits(self, request_id):
        # Allocated in full at admission; nothing changes until the request is freed.
        return float("inf"), float("inf")


MANAGER_FOR_SPEC: dict[type, type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
}
