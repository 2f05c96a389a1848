"""The hybrid KV cache manager: specs -> plan (groups, layout) -> manager -> coordinator ->
one manager per attention type -> one block pool."""
from distengine.kv_cache.manager import KVCacheManager, PrefixCacheStats
from distengine.kv_cache.plan import KVCachePlan, make_plan

__all__ = ["KVCacheManager", "KVCachePlan", "PrefixCacheStats", "make_plan"]
