"""The hybrid KV cache manager: specs -> plan (groups, layout) -> manager -> coordinator ->
one manager per attention type -> one block pool."""
from distengine.kv_cache.manager import KVCacheManager, PrefixCacheStats
from distengine.kv_cache.model_config import ConfigError, load_config_dict, parse_model_config
from distengine.kv_cache.plan import KVCachePlan, make_plan

__all__ = ["ConfigError", "KVCacheManager", "KVCachePlan", "PrefixCacheStats", "load_config_dict", "make_plan",
           "parse_model_config"]
