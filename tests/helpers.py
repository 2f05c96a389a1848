"""Small builders shared by the KV cache tests."""
from __future__ import annotations

from distengine.kv_cache.block_pool import FreeBlockQueue
from distengine.kv_cache.manager import KVCacheManager
from distengine.model_config import CHUNKED, MAMBA, SLIDING, LayerKV, MambaShape, ModelKVConfig
from distengine.kv_cache.plan import KVCachePlan, make_plan
from distengine.request import Request


def model(*kinds: tuple[str, int], window: int = 32, chunk: int = 64, max_len: int = 1 << 20,
          kv_heads: int = 2, head_dim: int = 8, mamba: MambaShape | None = None) -> ModelKVConfig:
    layers, i = [], 0
    for kind, count in kinds:
        for _ in range(count):
            layers.append(LayerKV(f"model.layers.{i}", kind, kv_heads if kind != MAMBA else 0,
                                  head_dim if kind != MAMBA else 0, window=window if kind == SLIDING else 0,
                                  chunk=chunk if kind == CHUNKED else 0,
                                  mamba=(mamba or MambaShape(1, 16, 4, 4)) if kind == MAMBA else None))
            i += 1
    return ModelKVConfig("test", "Test", tuple(layers), 2, max_len)


def plan_of(*kinds, block_size: int = 16, **kw) -> KVCachePlan:
    plan_kw = {k: kw.pop(k) for k in ("group_size", "state_pages", "mamba_checkpoint_interval") if k in kw}
    return make_plan(model(*kinds, **kw), block_size=block_size, **plan_kw)


def manager(plan: KVCachePlan, num_blocks: int = 100, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(plan, num_blocks, enable_caching=caching)


def admit(mgr: KVCacheManager, req: Request, num_new: int | None = None):
    """Prefix lookup + allocation of the rest of the prompt (or `num_new` tokens), as the
    scheduler does; marks the tokens computed when it succeeds."""
    blocks, hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - hit if num_new is None else num_new
    new = mgr.allocate_slots(req, n, hit, blocks)
    if new is not None:
        req.num_computed_tokens = hit + n
    return new, hit


def decode(mgr: KVCacheManager, req: Request, token: int = 7):
    req.append_output_token(token)
    new = mgr.allocate_slots(req, 1)
    if new is not None:
        req.num_computed_tokens += 1
    return new


def held(mgr: KVCacheManager, request_id: str) -> list[int]:
    """Real blocks per group of a request's tables."""
    return [sum(1 for b in t if b) for t in mgr.get_block_ids(request_id)]


def free_ids(queue: FreeBlockQueue) -> list[int]:
    """The free block ids in pop order, walking the queue node by node (checking its links) and
    counting the never-used range for its sentinel, without creating any block."""
    ids, prev, node = [], queue.head, queue.head.next
    while node is not queue.tail:
        assert node is not None and node.prev is prev, "free queue links broken"
        if node is queue.fresh:
            ids.extend(range(queue.fresh_start, queue.num_blocks))
        elif node is not queue.mid:
            ids.append(node.block_id)
        assert len(ids) <= queue.num_blocks, "free queue cycles"
        prev, node = node, node.next
    assert queue.tail.prev is prev
    return ids
