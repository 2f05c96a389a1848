"""Tensor-parallel workers (Ray actors, one per GPU): model runner, TP layers, models, weight
loading. They allocate the KV cache exactly as `distengine.kv_cache.plan.KVCachePlan` lays it out."""
