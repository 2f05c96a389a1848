"""The hybrid KV cache manager that the scheduler owns, with vLLM v1's interface."""
from __future__ import annotations

from dataclasses import dataclass

from distengine.kv_cache.coordinator import KVCacheBlocks, KVCacheCoordinator
from distengine.kv_cache.hashing import extend_block_hashes
from distengine.kv_cache.plan import KVCachePlan
from distengine.request import Request


@dataclass
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Blocks for every KV cache group of a plan, from one pool of `num_blocks` blocks.

    The data path of a request: `get_computed_blocks` (prefix hit) at admission, then
    `allocate_slots` before every step that computes tokens for it, `free` when it finishes, is
    preempted or aborted. Block tables are per group; entry i covers tokens [i*B, (i+1)*B).
    """

    def __init__(self, plan: KVCachePlan, num_blocks: int, enable_caching: bool = True) -> None:
        self.plan = plan
        self.block_size = plan.block_size
        self.max_model_len = plan.max_model_len
        self.enable_caching = enable_caching
        self.coordinator = KVCacheCoordinator([g.spec for g in plan.groups], num_blocks, enable_caching)
        self.pool = self.coordinator.pool
        self.num_groups = len(plan.groups)
        self.prefix_cache_stats = PrefixCacheStats()
        # request id -> (num_tokens, num_computed) up to which allocate_slots has nothing to do:
        # most decode steps stop at this check.
        self._quiet: dict[str, tuple[float, float]] = {}

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks (null block excluded) held by requests."""
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        if num_tokens // self.block_size > len(request.block_hashes):
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size,
                                request.cache_salt, num_tokens)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Prefix-cache hit for a request being admitted: blocks per group and the number of
        tokens they cover. At least one token is always left to compute, for its logits."""
        if not self.enable_caching or request.num_tokens <= 1:
            return self.coordinator.empty_blocks, 0
        self._update_block_hashes(request, request.num_tokens)
        blocks, num_hit = self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        stats = self.prefix_cache_stats
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit
        return blocks, num_hit

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0) -> tuple[list[int], ...] | None:
        """Make room for `num_new_tokens` tokens after the computed ones (and the prefix hit).

        Returns, per group, the block ids appended to the request's table (null entries
        included); None when the pool cannot serve it, in which case nothing has changed.
        """
        if not num_new_computed_tokens and not num_lookahead_tokens and num_new_tokens >= 0:
            quiet = self._quiet.get(request.request_id)
            if quiet is not None:
                end = request.num_computed_tokens + num_new_tokens
                if end <= quiet[0] and request.num_computed_tokens <= quiet[1] and \
                        end <= len(request.all_token_ids) + request.num_output_placeholders:
                    return self.coordinator.nothing_appended
        if num_new_tokens < 0 or num_lookahead_tokens < 0 or num_new_computed_tokens < 0:
            raise ValueError(f"request {request.request_id}: negative token count "
                             f"(new={num_new_tokens}, computed={num_new_computed_tokens}, "
                             f"lookahead={num_lookahead_tokens})")
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = num_computed + num_new_tokens + num_lookahead_tokens
        if num_tokens > self.max_model_len:
            raise ValueError(f"request {request.request_id}: {num_tokens} tokens exceed max_model_len "
                             f"{self.max_model_len}")
        if num_computed + num_new_tokens > request.num_tokens + request.num_output_placeholders:
            raise ValueError(f"request {request.request_id}: asked to compute up to token "
                             f"{num_computed + num_new_tokens} but it has {request.num_tokens}")
        coordinator = self.coordinator
        # Only known tokens are hashed and cached: a placeholder's value is still in flight.
        known_end = min(num_computed + num_new_tokens, request.num_tokens)
        if self.enable_caching:
            self._update_block_hashes(request, known_end)
        new = coordinator.allocate_slots(request, num_computed, num_tokens, new_computed_blocks)
        if new is None:
            return None
        if self.enable_caching:
            # Lookahead (speculative) slots are not cached: their tokens may be rejected.
            coordinator.cache_blocks(request, known_end)
        tokens, computed = coordinator.quiet_limits(request.request_id)
        self._quiet[request.request_id] = (min(tokens, self.max_model_len), computed)
        return new

    def free(self, request: Request) -> None:
        """Return a request's blocks (finished, preempted or aborted); cached ones stay findable."""
        if self.enable_caching:
            self._update_block_hashes(request, request.num_known_computed_tokens)
        self._quiet.pop(request.request_id, None)
        self.coordinator.free(request)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks. Refused (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.coordinator.get_block_ids(request_id)
