"""Joins the per-type managers: the prefix hit that holds in every group, and all-or-nothing
allocation across groups."""
from __future__ import annotations

from collections.abc import Sequence

from distengine.kv_cache.block_pool import BlockPool, KVCacheBlock
from distengine.kv_cache.single_type_manager import (MANAGER_FOR_SPEC, FullAttentionManager, MambaManager,
                                                     SingleTypeKVCacheManager)
from distengine.kv_cache.specs import KVCacheSpec
from distengine.request import Request

# One tuple entry per KV cache group.
KVCacheBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator:
    def __init__(self, group_specs: Sequence[KVCacheSpec], num_blocks: int, enable_caching: bool) -> None:
        self.num_groups = len(group_specs)
        self.block_size = group_specs[0].block_size  # one block size across groups (the plan's)
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, self.num_groups, enable_caching)
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for group_id, spec in enumerate(group_specs):
            by_spec.setdefault(spec, []).append(group_id)
        self.managers: list[SingleTypeKVCacheManager] = [
            MANAGER_FOR_SPEC[type(spec)](spec, group_ids, self.pool) for spec, group_ids in by_spec.items()]
        # Full attention first: its hit is prefix-closed, so it only ever gets truncated.
        self.full_managers = [m for m in self.managers if isinstance(m, FullAttentionManager)]
        self.other_cached_managers = [m for m in self.managers
                                      if not isinstance(m, FullAttentionManager) and m.spec.cacheable]
        # Mamba checkpoints where a prompt leaves the prefix cached in full-attention blocks.
        self.mamba_managers = [m for m in self.managers if isinstance(m, MambaManager)]
        self.last_allocation_lean = False  # the last allocation went without Mamba checkpoints
        for m in self.mamba_managers:
            if self.full_managers:
                m.prefix_group = self.full_managers[0].group_ids[0]
        self.empty_blocks: KVCacheBlocks = tuple([] for _ in range(self.num_groups))
        # Returned when an allocation appends nothing: shared, never to be mutated.
        self.nothing_appended: tuple[list[int], ...] = tuple([] for _ in range(self.num_groups))

    def find_longest_cache_hit(self, block_hashes: Sequence[int], max_length: int) -> tuple[KVCacheBlocks, int]:
        """The longest prefix of at most `max_length` tokens that hits in every group.

        Full-attention managers first, then a fixed point over the others: each one's answer
        for a bound h is a hit h' <= h that it would give again for bound h', so re-asking only
        those whose last answer differs from the current bound terminates with every group
        agreeing.
        """
        hit = max_length
        found: dict[int, list[list[KVCacheBlock]]] = {}
        for m in self.full_managers:
            found[id(m)], hit = m.find_longest_cache_hit(block_hashes, hit)
        answered: dict[int, int] = {}
        while True:
            stale = [m for m in self.other_cached_managers if answered.get(id(m)) != hit]
            if not stale:
                break
            for m in stale:
                found[id(m)], answered[id(m)] = m.find_longest_cache_hit(block_hashes, hit)
                hit = min(hit, answered[id(m)])
        num_blocks = hit // self.block_size
        out: list[list[KVCacheBlock]] = [[] for _ in range(self.num_groups)]
        for m in self.full_managers + self.other_cached_managers:
            for group_id, blocks in zip(m.group_ids, found[id(m)]):
                out[group_id] = blocks[:num_blocks]
        return tuple(out), hit

    def allocate_slots(self, request: Request, num_computed: int, num_tokens: int,
                       new_computed: KVCacheBlocks | None) -> tuple[list[int], ...] | None:
        """Blocks for tokens up to `num_tokens`; None, with nothing changed, if the pool is short."""
        managers = self.managers
        if new_computed is not None and not any(new_computed):
            new_computed = None
        if self.enable_caching:
            # Computed blocks not registered yet: Mamba states, and attention blocks whose
            # registration was deferred (see quiet_limits).
            for m in managers:
                m.cache_blocks(request.request_id, request.block_hashes, request.num_known_computed_tokens)
        hits = [[new_computed[g] for g in m.group_ids] if new_computed else None for m in managers]
        need = self._need(request, num_computed, num_tokens, hits)
        lean = self.last_allocation_lean = False
        if need > self.pool.free_queue.num_free_blocks and self.mamba_managers:
            # Without Mamba checkpoints (they only serve later prefix hits).
            lean = self.last_allocation_lean = True
            for m in self.mamba_managers:
                m.lean = True
            need = self._need(request, num_computed, num_tokens, hits)
        try:
            if need > self.pool.free_queue.num_free_blocks:
                return None
            return self._allocate(request, num_computed, num_tokens, hits)
        finally:
            if lean:
                for m in self.mamba_managers:
                    m.lean = False

    def _need(self, request: Request, num_computed: int, num_tokens: int, hits) -> int:
        return sum(m.num_blocks_to_allocate(request, num_computed, num_tokens, sub)
                   for m, sub in zip(self.managers, hits))

    def _allocate(self, request: Request, num_computed: int, num_tokens: int, hits) -> tuple[list[int], ...]:
        managers = self.managers
        appended: list[list[int]] | None = None
        # Every group takes its prefix-hit blocks and frees its skipped ones before any group
        # pops a new block: otherwise a pop may evict another group's free hit block, or find
        # the pool short of blocks that `need` counted as freed.
        for m, sub in zip(managers, hits):
            m.take_hits_and_skip(request, num_computed, sub)
        for m in managers:
            rows = m.allocate_new(request, num_computed, num_tokens)
            if rows is not None:
                if appended is None:
                    appended = [[] for _ in range(self.num_groups)]
                for group_id, row in zip(m.group_ids, rows):
                    appended[group_id] = row
        return tuple(appended) if appended is not None else self.nothing_appended

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for m in self.managers:
            if m.cache_ahead:
                m.cache_blocks(request.request_id, request.block_hashes, num_tokens)

    def free(self, request: Request) -> None:
        # Full blocks whose registration was deferred to the next allocation (see quiet_limits).
        if self.enable_caching:
            for m in self.managers:
                m.cache_blocks(request.request_id, request.block_hashes, request.num_known_computed_tokens)
        for m in self.managers:
            m.free(request.request_id)

    def quiet_limits(self, request_id: str) -> tuple[float, float]:
        tokens = computed = float("inf")
        for m in self.managers:
            t, c = m.quiet_limits(request_id)
            tokens, computed = min(tokens, t), min(computed, c)
        return tokens, computed

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        out: list[list[int]] = [[] for _ in range(self.num_groups)]
        for m in self.managers:
            for group_id, row in zip(m.group_ids, m.block_ids(request_id)):
                out[group_id] = row
        return tuple(out)

