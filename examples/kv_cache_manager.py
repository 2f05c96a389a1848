"""The hybrid KV cache manager driven by hand, the way the scheduler drives it.

    python examples/kv_cache_manager.py
"""
from distengine.kv_cache import KVCacheManager, make_plan
from distengine.model_config import load_config_dict, parse_model_config
from distengine.request import Request

name, cfg = load_config_dict("gemma-3-27b")
plan = make_plan(parse_model_config(cfg, name), max_model_len=8192)
manager = KVCacheManager(plan, num_blocks=4000)

system = list(range(1000))
for i, suffix in enumerate([[7] * 300, [8] * 200]):
    req = Request(f"req-{i}", system + suffix)
    blocks, num_hit = manager.get_computed_blocks(req)  # prefix-cache hit at admission
    new = manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, blocks)
    assert new is not None, "pool too small"
    req.num_computed_tokens = req.num_tokens  # the step ran
    for token in range(40):  # decode steps: one token each
        req.append_output_token(token)
        manager.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    held = [sum(1 for b in table if b) for table in manager.get_block_ids(req.request_id)]
    print(f"{req.request_id}: hit {num_hit} of {req.num_prompt_tokens} prompt tokens; blocks per group {held}")

print(f"usage {manager.usage:.1%}, prefix-cache hit rate {manager.prefix_cache_stats.hit_rate:.1%}")
