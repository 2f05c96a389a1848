"""The KV cache plan: block size, KV cache groups and the shared buffer layout.

Layers are grouped by spec (one attention type per group) into groups of the same number of
layer slots m; the last group of a type is padded. For n groups of m slots the cache is m
buffers, buffer j holding slot j of every group; a block id addresses the same page offset in all
m buffers, so one block costs m pages. The workers allocate exactly this.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from distengine.kv_cache.model_config import (CHUNKED, CROSS, FULL, MAMBA, SLIDING, ConfigError, LayerKV,
                                              ModelKVConfig)
from distengine.kv_cache.specs import (ChunkedLocalAttentionSpec, CrossAttentionSpec, FullAttentionSpec,
                                       KVCacheSpec, MambaSpec, SlidingWindowSpec, cdiv)

GIB = 1 << 30
DEFAULT_MAX_NUM_GROUPS = 16
# Order of the groups in the plan (and of their block tables in a step).
_KIND_ORDER = {FULL: 0, SLIDING: 1, CHUNKED: 2, MAMBA: 3, CROSS: 4}


@dataclass(frozen=True)
class KVCacheGroup:
    group_id: int
    spec: KVCacheSpec
    layers: tuple[str | None, ...]  # one per slot; None is a padding slot

    @property
    def padding(self) -> int:
        return sum(1 for x in self.layers if x is None)


@dataclass(frozen=True)
class GroupSizeChoice:
    group_size: int
    num_groups: int
    padding_slots: int
    waste_pages: int  # padding pages held by one request at the target length
    rule: str


@dataclass
class KVCachePlan:
    model: str
    tp_size: int
    block_size: int
    page_size_bytes: int  # one block in one buffer
    num_slots: int  # layers per group = number of buffers
    groups: list[KVCacheGroup]
    layer_slots: dict[str, tuple[int, int]]  # layer -> (group id, slot = buffer index)
    shared_layers: dict[str, str]  # layer -> layer whose K/V it reads
    max_model_len: int
    target_len: int
    choice: GroupSizeChoice
    baseline: GroupSizeChoice  # vLLM's rule, for comparison
    requested_block_size: int  # the block size asked for (raised when Mamba layers need it)
    layers: tuple[LayerKV, ...] = field(repr=False, default=())
    dtype_bytes: int = 2

    @property
    def block_bytes(self) -> int:
        """Memory of one block id: a page in each of the m buffers."""
        return self.num_slots * self.page_size_bytes

    def num_blocks_for_memory(self, memory_bytes: int) -> int:
        """Blocks (the null block included) that fit in `memory_bytes` of KV cache."""
        return memory_bytes // self.block_bytes

    def blocks_per_group(self, num_tokens: int, num_encoder_tokens: int = 0) -> list[int]:
        """Real blocks one request of `num_tokens` computed tokens holds, per group."""
        return [g.spec.blocks_held(num_tokens, num_encoder_tokens) for g in self.groups]

    def bytes_per_request(self, num_tokens: int) -> int:
        return sum(self.blocks_per_group(num_tokens)) * self.block_bytes

    def uniform_bytes_per_request(self, num_tokens: int) -> int:
        """Every layer keeping K/V for every token (a Mamba layer: its state), nothing shared."""
        total = 0
        for layer in self.layers:
            if layer.kv_sharing_target:
                continue
            if layer.kind == MAMBA:
                total += layer.state_bytes(self.tp_size, self.dtype_bytes)
            else:
                total += cdiv(num_tokens, self.block_size) * self.block_size * \
                    layer.bytes_per_token(self.tp_size, self.dtype_bytes)
        return total

    def to_dict(self, memory_bytes: int | None = None, tokens: int | None = None) -> dict:
        out: dict = {
            "model": self.model, "tp_size": self.tp_size, "block_size": self.block_size,
            "page_size_bytes": self.page_size_bytes, "num_buffers": self.num_slots,
            "block_bytes": self.block_bytes, "max_model_len": self.max_model_len,
            "groups": [{"group_id": g.group_id, "type": g.spec.kind, "spec": g.spec.describe(),
                        "layers": list(g.layers), "padding": g.padding} for g in self.groups],
            "shared_layers": self.shared_layers,
            "group_size": {"chosen": self.choice.__dict__, "vllm_rule": self.baseline.__dict__,
                           "target_len": self.target_len},
        }
        if memory_bytes is not None:
            n = self.num_blocks_for_memory(memory_bytes)
            ours = self.bytes_per_request(self.max_model_len)
            uniform = self.uniform_bytes_per_request(self.max_model_len)
            out["memory_bytes"] = memory_bytes
            out["num_blocks"] = n
            out["capacity_tokens_at_max_model_len"] = self.max_model_len * (n - 1) * self.block_bytes // ours
            out["uniform_capacity_tokens_at_max_model_len"] = self.max_model_len * memory_bytes // uniform
        if tokens is not None:
            out["tokens"] = tokens
            out["blocks_per_group"] = self.blocks_per_group(tokens)
            out["bytes_per_request"] = self.bytes_per_request(tokens)
            out["vllm_rule_bytes_per_request"] = plan_with_group_size(self, self.baseline.group_size) \
                .bytes_per_request(tokens)
            out["uniform_bytes_per_request"] = self.uniform_bytes_per_request(tokens)
        return out


def _attention_spec(layer: LayerKV, block_size: int, bpt: int) -> KVCacheSpec:
    if layer.kind == FULL:
        return FullAttentionSpec(block_size, bpt)
    if layer.kind == SLIDING:
        return SlidingWindowSpec(block_size, bpt, window=layer.window)
    if layer.kind == CHUNKED:
        if layer.chunk % block_size:
            raise ConfigError(f"{layer.name}: attention chunk {layer.chunk} is not a multiple of the "
                              f"block size {block_size}")
        return ChunkedLocalAttentionSpec(block_size, bpt, chunk=layer.chunk)
    if layer.kind == CROSS:
        return CrossAttentionSpec(block_size, bpt)
    raise ConfigError(f"{layer.name}: unknown layer kind {layer.kind}")


def layer_specs(model: ModelKVConfig, tp_size: int = 1, block_size: int = 16) -> dict[str, KVCacheSpec]:
    """One spec per layer that owns KV memory, with a single page size across all of them.

    Attention layers must keep the same bytes per token. Mamba states are much larger than an
    attention page: the attention block size is raised, in multiples of `block_size`, until
    its page holds a state, and the state page is padded to the attention page.
    """
    if tp_size < 1 or block_size < 1:
        raise ConfigError(f"tp size and block size must be >= 1 (got {tp_size}, {block_size})")
    own = [layer for layer in model.layers if not layer.kv_sharing_target]
    attn = [layer for layer in own if layer.kind != MAMBA]
    mamba = [layer for layer in own if layer.kind == MAMBA]
    bpts = sorted({layer.bytes_per_token(tp_size, model.dtype_bytes) for layer in attn})
    if len(bpts) > 1:
        raise ConfigError(f"attention layers keep different bytes per token ({bpts}); one page size "
                          f"across groups needs them equal")
    states = sorted({layer.state_bytes(tp_size, model.dtype_bytes) for layer in mamba})
    if len(states) > 1:
        raise ConfigError(f"Mamba layers keep different state sizes ({states})")
    specs: dict[str, KVCacheSpec] = {}
    bs = block_size
    if attn and mamba:
        bs = block_size * cdiv(states[0], block_size * bpts[0])
    page = bs * bpts[0] if attn else states[0]
    for layer in attn:
        specs[layer.name] = _attention_spec(layer, bs, bpts[0])
    for layer in mamba:
        specs[layer.name] = MambaSpec(bs, 0, state_bytes=states[0], page_bytes=page)
    return specs


def vllm_group_size(counts: list[int]) -> int:
    """vLLM's rule: the smallest layer count of any type, or the largest when it is below 1.5x
    the smallest (fewer groups, a little padding)."""
    lo, hi = min(counts), max(counts)
    return hi if hi < 1.5 * lo else lo


def _evaluate(counts: dict[KVCacheSpec, int], g: int, target_len: int, rule: str) -> GroupSizeChoice:
    groups = sum(cdiv(c, g) for c in counts.values())
    pad = {s: cdiv(c, g) * g - c for s, c in counts.items()}
    waste = sum(p * s.blocks_held(target_len) for s, p in pad.items())
    return GroupSizeChoice(g, groups, sum(pad.values()), waste, rule)


def choose_group_size(counts: dict[KVCacheSpec, int], target_len: int,
                      max_num_groups: int = DEFAULT_MAX_NUM_GROUPS) -> GroupSizeChoice:
    """The group size that wastes the fewest padding pages for one request of `target_len`
    tokens, among those giving at most `max_num_groups` groups; ties go to fewer groups."""
    if len(counts) > max_num_groups:
        raise ConfigError(f"{len(counts)} layer types need at least {len(counts)} groups; "
                          f"max_num_groups is {max_num_groups}")
    best = None
    for g in range(1, max(counts.values()) + 1):
        c = _evaluate(counts, g, target_len, "min padding")
        if c.num_groups > max_num_groups:
            continue
        if best is None or (c.waste_pages, c.num_groups) < (best.waste_pages, best.num_groups):
            best = c
    assert best is not None
    return GroupSizeChoice(best.group_size, best.num_groups, best.padding_slots, best.waste_pages,
                           f"fewest padding pages at {target_len} tokens, at most {max_num_groups} groups")


def make_plan(model: ModelKVConfig, tp_size: int = 1, block_size: int = 16, max_model_len: int | None = None,
              target_len: int | None = None, max_num_groups: int = DEFAULT_MAX_NUM_GROUPS,
              group_size: int | None = None) -> KVCachePlan:
    max_model_len = max_model_len or model.max_model_len
    if max_model_len < 1:
        raise ConfigError(f"max_model_len must be >= 1, got {max_model_len}")
    target_len = target_len or max_model_len
    specs = layer_specs(model, tp_size, block_size)
    if not specs:
        raise ConfigError(f"{model.name}: no layer keeps KV cache or state")
    counts = Counter(specs.values())
    baseline = _evaluate(counts, vllm_group_size(list(counts.values())), target_len, "vLLM")
    if group_size is not None:
        if group_size < 1:
            raise ConfigError(f"group size must be >= 1, got {group_size}")
        choice = _evaluate(counts, group_size, target_len, "given")
    else:
        choice = choose_group_size(counts, target_len, max_num_groups)
    spec_order = sorted(counts, key=lambda s: (_KIND_ORDER[s.kind], s.describe()))
    g = choice.group_size
    groups: list[KVCacheGroup] = []
    layer_slots: dict[str, tuple[int, int]] = {}
    for spec in spec_order:
        names = [n for n, s in specs.items() if s == spec]
        for start in range(0, len(names), g):
            chunk = names[start:start + g]
            gid = len(groups)
            groups.append(KVCacheGroup(gid, spec, tuple(chunk) + (None,) * (g - len(chunk))))
            for slot, name in enumerate(chunk):
                layer_slots[name] = (gid, slot)
    shared = {layer.name: layer.kv_sharing_target for layer in model.layers if layer.kv_sharing_target}
    any_spec = next(iter(specs.values()))
    return KVCachePlan(model=model.name, tp_size=tp_size, block_size=any_spec.block_size,
                       page_size_bytes=any_spec.page_size_bytes, num_slots=g, groups=groups,
                       layer_slots=layer_slots, shared_layers=shared, max_model_len=max_model_len,
                       target_len=target_len, choice=choice, baseline=baseline,
                       requested_block_size=block_size, layers=model.layers, dtype_bytes=model.dtype_bytes)


def plan_with_group_size(plan: KVCachePlan, group_size: int) -> KVCachePlan:
    """The same model planned with another group size (to compare layouts)."""
    model = ModelKVConfig(plan.model, "", plan.layers, plan.dtype_bytes, plan.max_model_len)
    return make_plan(model, plan.tp_size, plan.requested_block_size, plan.max_model_len, plan.target_len,
                     group_size=group_size)
