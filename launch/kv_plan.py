"""`distengine kv-plan`: print the KV cache plan of a model."""
from __future__ import annotations

import json

from distengine.kv_cache.model_config import load_config_dict, parse_model_config
from distengine.kv_cache.plan import GIB, KVCachePlan, make_plan, plan_with_group_size


def _layer_list(layers: tuple[str | None, ...]) -> str:
    idx = [name.rsplit(".", 1)[-1] if name else "-" for name in layers]
    return "layers " + ",".join(idx)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def build_plan(args) -> KVCachePlan:
    name, cfg = load_config_dict(args.config)
    model = parse_model_config(cfg, name, args.kv_cache_dtype)
    return make_plan(model, tp_size=args.tp, block_size=args.block_size, max_model_len=args.max_model_len,
                     max_num_groups=args.max_num_groups, group_size=args.group_size)


def run(args) -> int:
    plan = build_plan(args)
    memory = int(args.memory_gib * GIB)
    data = plan.to_dict(memory, args.tokens)
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    c, b = plan.choice, plan.baseline
    print(f"model {plan.model}  tp={plan.tp_size}  kv bytes/elem={plan.dtype_bytes}  "
          f"max_model_len={plan.max_model_len}")
    print(f"block size {plan.block_size} tokens"
          + (f" (raised from {plan.requested_block_size} so that an attention page holds a Mamba state)"
             if plan.block_size != plan.requested_block_size else ""))
    print(f"page {plan.page_size_bytes:,} B (one layer, one block); {plan.num_slots} buffers "
          f"(one per layer slot, shared by every group); one block id = {plan.block_bytes:,} B")
    print(f"group size {c.group_size} ({c.rule}): {c.num_groups} groups, {c.padding_slots} padding slots")
    print(f"  vLLM's rule: group size {b.group_size}: {b.num_groups} groups, {b.padding_slots} padding slots")
    for g in plan.groups:
        print(f"  group {g.group_id:2d}  {g.spec.describe():32s} {_layer_list(g.layers)}"
              + (f"  (padding {g.padding})" if g.padding else ""))
    if plan.shared_layers:
        print("  KV shared (no allocation): " + ", ".join(f"{k} -> {v}" for k, v in plan.shared_layers.items()))
    print(f"{args.memory_gib:g} GiB of KV cache per rank: {data['num_blocks']:,} blocks (block 0 is the null block)")
    ours, uni = data["capacity_tokens_at_max_model_len"], data["uniform_capacity_tokens_at_max_model_len"]
    print(f"capacity at {plan.max_model_len} tokens per request: {ours:,} tokens; uniform full-attention "
          f"allocation: {uni:,} tokens ({ours / max(uni, 1):.2f}x)")
    if args.tokens is not None:
        vllm_plan = plan_with_group_size(plan, b.group_size)
        print(f"one request of {args.tokens} tokens holds blocks per group {data['blocks_per_group']} "
              f"(= {sum(data['blocks_per_group'])} blocks, null blocks excluded)")
        print(f"  bytes: ours {_mib(data['bytes_per_request'])}; vLLM's layout {_mib(data['vllm_rule_bytes_per_request'])} "
              f"(blocks {vllm_plan.blocks_per_group(args.tokens)}); uniform {_mib(data['uniform_bytes_per_request'])}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--config", default="gemma-3-27b",
                   help="a config.json, a folder holding one, or a built-in name (default: gemma-3-27b)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (KV heads per rank)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None, help="default: the config's max_position_embeddings")
    p.add_argument("--memory-gib", type=float, default=64.0, help="KV cache memory per rank")
    p.add_argument("--tokens", type=int, default=None, help="show the blocks one request of T tokens holds")
    p.add_argument("--max-num-groups", type=int, default=16, help="bound on KV cache groups (block tables per step)")
    p.add_argument("--group-size", type=int, default=None, help="force the layers per group")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--json", action="store_true")
