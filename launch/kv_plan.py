"""`distengine kv-plan`: print the KV cache plan of a model."""
from __future__ import annotations

import json

from distengine.model_config import KV_CACHE_DTYPES, MAMBA, load_config_dict, parse_model_config
from distengine.kv_cache.plan import GIB, PACKED, PADDED, VLLM, KVCacheGroup, KVCachePlan, make_plan, vllm_plan


def _layer_list(group: KVCacheGroup) -> str:
    """Layer indices, one per layer (a Mamba state fills several slots), "-" per padding slot;
    Falcon-H1's Mamba mixers show as "7m"; the layers sharing a packed page joined by "+"."""
    idx = []
    layers = group.layers
    for i, name in enumerate(layers):
        if name is None:
            idx.append("-")
        elif i == 0 or layers[i - 1] != name:
            parts = name.split(".")
            idx.append(parts[2] + ("m" if parts[-1] == "mamba" else "") if len(parts) > 2 else name)
    if group.per_slot > 1:
        r = group.per_slot
        idx = ["+".join(idx[j:j + r]) for j in range(0, len(idx), r)]
    return "layers " + ",".join(idx)


def _size(n: int) -> str:
    """Bytes in the unit that shows them (a tiny model's request is KiB, not 0.0 MiB)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} B"


def _dtype_note(cfg: dict, args, dtype_bytes: int) -> str:
    if args.kv_cache_dtype != "auto":
        return f"{args.kv_cache_dtype}: e4m3 K/V; states keep the model's dtype"
    if args.dtype != "auto":
        return f"auto: the model's {args.dtype}"
    text = cfg.get("text_config") or cfg
    ckpt = text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if ckpt in ("float32", "float") and dtype_bytes == 2:
        return "auto: bfloat16 for this float32 checkpoint, as served on GPUs (--dtype float32 for CPU)"
    return f"auto: the checkpoint's {ckpt}"


def build_plan(args) -> KVCachePlan:
    name, cfg = load_config_dict(args.config)
    model = parse_model_config(cfg, name, args.kv_cache_dtype, args.dtype)
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
    _, cfg = load_config_dict(args.config)
    mamba = any(layer.kind == MAMBA for layer in plan.layers)
    baseline = ("unpooled (every Mamba layer its exact state, every attention layer K/V for every token: "
                "what separate caches would hold; our single pool pads all to one page size)" if mamba
                else "uniform (every layer keeping K/V for every token)")
    print(f"model {plan.model}  tp={plan.tp_size}  KV bytes per element {plan.dtype_bytes} "
          f"({_dtype_note(cfg, args, plan.dtype_bytes)})  max_model_len={plan.max_model_len}")
    mamba_spec = next((g.spec for g in plan.groups if g.spec.kind == MAMBA), None)
    raised = ""
    if plan.block_size != plan.requested_block_size:
        where = "one page" if plan.state_pages == 1 else f"{mamba_spec.pages} pages of a block"
        raised = f" (raised from {plan.requested_block_size} so that {where} hold a Mamba state)"
    print(f"block size {plan.block_size} tokens{raised}")
    print(f"page {plan.page_size_bytes:,} B (one layer slot of one block); a block is {plan.num_slots} pages side by "
          f"side, one per layer slot; one block id = {plan.block_bytes:,} B")
    if plan.mixed_sizes:
        how = {PACKED: "a smaller layer shares its page slot with others of its spec (layers a+b: sub-pages of one "
                       "page)",
               PADDED: "a smaller layer takes a whole page, the rest unused"}[plan.layout]
        sizes = sorted({g.spec.page_size_bytes for g in plan.groups}, reverse=True)
        print(f"layout: {plan.layout} pages (attention layers keep {', '.join(f'{s:,}' for s in sizes)} B per block of "
              f"{plan.block_size} tokens; the page is the largest): {how}")
    if mamba_spec is not None:
        every = mamba_spec.checkpoint_interval
        print(f"Mamba: a state spans {mamba_spec.pages} page(s); prefix hits resolve to {plan.block_size} tokens; "
              f"states kept at each step's last block end and where prompts diverge"
              + (f", and every {every} tokens" if every else ""))
    print(f"group size {c.group_size} ({c.rule}): {c.num_groups} groups, {c.padding_slots} padding slots")
    print(f"  vLLM's rule: group size {b.group_size}: {b.num_groups} groups, {b.padding_slots} padding slots")
    for g in plan.groups:
        size = f" {g.spec.page_size_bytes // 1024} KiB" if plan.mixed_sizes else ""
        print(f"  group {g.group_id:2d}  {g.spec.describe() + size:36s} {_layer_list(g)}"
              + (f"  (padding {g.padding})" if g.padding else ""))
    if plan.shared_layers:
        print("  KV shared (no allocation): " + ", ".join(f"{k} -> {v}" for k, v in plan.shared_layers.items()))
    print(f"{args.memory_gib:g} GiB of KV cache per rank: {data['num_blocks']:,} blocks (block 0 is the null block)")
    ours, uni = data["capacity_tokens_at_max_model_len"], data["uniform_capacity_tokens_at_max_model_len"]
    print(f"capacity at {plan.max_model_len} tokens per request: {ours:,} tokens; {baseline}: {uni:,} tokens "
          f"({ours / max(uni, 1):.2f}x)")
    if args.tokens is not None:
        vllm = vllm_plan(plan)
        print(f"one request of {args.tokens} tokens holds blocks per group {data['blocks_per_group']} "
              f"(= {sum(data['blocks_per_group'])} blocks, null blocks excluded)")
        block_sizes = "/".join(str(b) for b in sorted({g.spec.block_size for g in vllm.groups}))
        print(f"  bytes: ours {_size(data['bytes_per_request'])}; vLLM's layout {_size(data['vllm_rule_bytes_per_request'])} "
              f"(block size {block_sizes}, blocks {vllm.blocks_per_group(args.tokens)}); {'unpooled' if mamba else 'uniform'} "
              f"{_size(data['uniform_bytes_per_request'])}")
        layouts = data["layouts_bytes_per_request"]
        if layouts:
            ours, uni = data["bytes_per_request"], data["uniform_bytes_per_request"]
            vl = layouts.get(VLLM)
            parts = []
            for name in (PACKED, PADDED, VLLM):
                n = layouts.get(name)
                label = {PACKED: "packed pages", PADDED: "padded pages", VLLM: "vLLM's layout"}[name]
                chosen = " (chosen)" if name == plan.layout else ""
                if n is None:
                    parts.append(f"{label}: n/a (page sizes do not divide)")
                    continue
                vs = f", {n / vl:.2f}x vLLM's" if vl else ""
                parts.append(f"{label}{chosen} {_size(n)} ({n / max(uni, 1):.3f}x uniform{vs})")
            print("  layouts at this length: " + "; ".join(parts))
            if vl:
                print(f"  ours / vLLM's layout: {ours / vl:.3f}; ours / uniform: {ours / max(uni, 1):.3f}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--config", default="gemma-3-27b",
                   help="a config.json, a folder holding one, or a built-in name (see the README)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (KV heads per rank)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (raised for Mamba states)")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the config's max_position_embeddings")
    p.add_argument("--memory-gib", type=float, default=64.0, help="KV cache memory per rank, GiB")
    p.add_argument("--tokens", type=int, default=None, help="also show the blocks one request of T tokens holds")
    p.add_argument("--max-num-groups", type=int, default=16, help="bound on KV cache groups (block tables per step)")
    p.add_argument("--group-size", type=int, default=None, help="force the layers per group")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="the model's dtype, which Mamba states keep (auto: the checkpoint's, bfloat16 for a float32 "
                        "one, as served on GPUs)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the attention K/V's: auto (the model's dtype) or fp8 / fp8_e4m3 (1 byte an element)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
