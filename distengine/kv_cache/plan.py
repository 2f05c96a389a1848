"""The KV cache plan: block size, KV cache groups and the shared buffer layout.

Layers are grouped by spec (one attention type per group) into groups of the same number of
layer slots m; the last group of a type is padded. The cache is one buffer of blocks, each block
m pages side by side (`[num_blocks, m, page]`): block id b of a group gives page j of block b to
the group's layer(s) in slot j, so one block costs m pages. An attention layer's K/V for
`block_size` tokens fill its page; a Mamba layer's state spans `pages` consecutive slots of a
block, so the block size (the prefix-hit granularity) need not grow until one page holds a whole
state.

Attention layers of different per-token sizes (Gemma 4: sliding layers 16 KiB, full layers
8 KiB per token) keep the one block size: the page is `block_size` tokens of the largest layer,
and a smaller layer either takes a whole page (padded) or shares a page slot with other layers
of its spec (packed: a page holds `largest // own` sub-pages, each one layer's K/V for the
block's tokens). The plan takes the layout holding one request of the target length in the least
memory. The workers allocate exactly this.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction

from distengine.model_config import (CHUNKED, CROSS, FULL, MAMBA, SLIDING, ConfigError, LayerKV,
                                              ModelKVConfig)
from distengine.kv_cache.specs import (ChunkedLocalAttentionSpec, CrossAttentionSpec, FullAttentionSpec,
                                       KVCacheSpec, MambaSpec, SlidingWindowSpec, cdiv)

GIB = 1 << 30
DEFAULT_MAX_NUM_GROUPS = 16
# Order of the groups in the plan (and of their block tables in a step).
_KIND_ORDER = {FULL: 0, SLIDING: 1, CHUNKED: 2, MAMBA: 3, CROSS: 4}


# Layouts of attention layers of different per-token sizes (the plan's `layout`).
EQUAL, PACKED, PADDED, VLLM = "equal pages", "packed", "padded", "vllm"


@dataclass(frozen=True)
class KVCacheGroup:
    group_id: int
    spec: KVCacheSpec
    # One per layer position: slot j holds positions j*per_slot .. (j+1)*per_slot - 1 (a Mamba
    # layer repeats in each slot its state spans); None: padding.
    layers: tuple[str | None, ...]
    per_slot: int = 1  # layers sharing one page slot (packed pages: each a sub-page)

    @property
    def padding(self) -> int:
        """Unused layer positions (sub-pages of a packed group)."""
        return sum(1 for x in self.layers if x is None)

    @property
    def num_slots(self) -> int:
        return len(self.layers) // self.per_slot


@dataclass(frozen=True)
class LayerPlacement:
    """Where a layer's cache sits in every block of its group: page slot `slot` (the first of
    those a Mamba state spans) and, in a packed page, sub-page `sub_page` (the layer's own page
    size from the start of the slot's page)."""
    group_id: int
    slot: int
    sub_page: int = 0


@dataclass(frozen=True)
class GroupSizeChoice:
    group_size: int
    num_groups: int
    padding_slots: int
    waste_pages: int | float  # padding pages held by one request at the target length (packed: fractions)
    rule: str


@dataclass
class KVCachePlan:
    model: str
    tp_size: int
    block_size: int
    page_size_bytes: int  # one page: one layer slot of one block (the largest layer's block of K/V)
    num_slots: int  # pages per block (layer slots per group)
    groups: list[KVCacheGroup]
    layer_slots: dict[str, LayerPlacement]  # layers that own cache (shared ones: `shared_layers`)
    shared_layers: dict[str, str]  # layer -> layer whose K/V it reads
    max_model_len: int
    target_len: int
    choice: GroupSizeChoice
    baseline: GroupSizeChoice  # vLLM's rule, for comparison
    requested_block_size: int  # the block size asked for (raised when Mamba layers need it)
    layers: tuple[LayerKV, ...] = field(repr=False, default=())
    dtype_bytes: int = 2  # an attention K/V element's (1: an fp8 KV cache)
    state_dtype_bytes: int = 0  # a Mamba state element's where it differs (ModelKVConfig's)
    state_pages: int = 1  # pages one Mamba state spans
    mamba_checkpoint_interval: int | None = None  # as asked (None: the default)
    layout: str = EQUAL  # EQUAL (one per-token size), PACKED, PADDED, or VLLM (only to compare)

    @property
    def mamba_group_ids(self) -> list[int]:
        """The Mamba groups in plan order: a step's Mamba metadata has a row for each, in this order."""
        return [g.group_id for g in self.groups if g.spec.kind == MAMBA]

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

    def peak_blocks_per_group(self, num_tokens: int, chunk: int) -> list[int]:
        """The most real blocks one request of up to `num_tokens` tokens holds at once, per group,
        its prompt computed in chunks of up to `chunk` tokens."""
        return [g.spec.peak_blocks(num_tokens, chunk) for g in self.groups]

    def bytes_per_request(self, num_tokens: int) -> int:
        return sum(self.blocks_per_group(num_tokens)) * self.block_bytes

    def uniform_bytes_per_request(self, num_tokens: int) -> int:
        """Every layer keeping K/V for every token (a Mamba layer: its state), nothing shared."""
        total = 0
        for layer in self.layers:
            if layer.kv_sharing_target:
                continue
            if layer.kind == MAMBA:
                total += layer.state_bytes(self.tp_size, self.state_dtype_bytes or self.dtype_bytes)
            else:
                total += cdiv(num_tokens, self.block_size) * self.block_size * \
                    layer.bytes_per_token(self.tp_size, self.dtype_bytes)
        return total

    def to_dict(self, memory_bytes: int | None = None, tokens: int | None = None) -> dict:
        out: dict = {
            "model": self.model, "tp_size": self.tp_size, "block_size": self.block_size,
            "page_size_bytes": self.page_size_bytes, "num_buffers": self.num_slots,
            "block_bytes": self.block_bytes, "max_model_len": self.max_model_len,
            "state_pages": self.state_pages, "layout": self.layout, "kv_dtype_bytes": self.dtype_bytes,
            "state_dtype_bytes": self.state_dtype_bytes or self.dtype_bytes,
            "groups": [{"group_id": g.group_id, "type": g.spec.kind, "spec": g.spec.describe(),
                        "layers": list(g.layers), "padding": g.padding, "layers_per_slot": g.per_slot,
                        "sub_page_bytes": g.spec.page_size_bytes}
                       for g in self.groups],
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
            out["vllm_rule_bytes_per_request"] = vllm_plan(self).bytes_per_request(tokens)
            out["uniform_bytes_per_request"] = self.uniform_bytes_per_request(tokens)
            out["layouts_bytes_per_request"] = {
                name: (p.bytes_per_request(tokens) if p is not None else None)
                for name, p in layout_plans(self).items()}
        return out

    @property
    def mixed_sizes(self) -> bool:
        """Attention layers keep different bytes per token (packed or padded pages)."""
        return len({layer.bytes_per_token(self.tp_size, self.dtype_bytes) for layer in self.layers
                    if layer.kind != MAMBA and not layer.kv_sharing_target}) > 1


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


def _sizes(model: ModelKVConfig, tp_size: int) -> tuple[list[LayerKV], list[LayerKV], int, int]:
    """(attention layers, Mamba layers, the largest attention bytes per token, Mamba state bytes)."""
    own = [layer for layer in model.layers if not layer.kv_sharing_target]
    attn = [layer for layer in own if layer.kind != MAMBA]
    mamba = [layer for layer in own if layer.kind == MAMBA]
    bpts = sorted({layer.bytes_per_token(tp_size, model.dtype_bytes) for layer in attn})
    if len(bpts) > 1 and mamba:
        raise ConfigError(f"attention layers keep different bytes per token ({bpts}) beside Mamba layers; "
                          f"pages of different sizes are planned for attention-only models")
    states = sorted({layer.state_bytes(tp_size, model.state_bytes_per_element) for layer in mamba})
    if len(states) > 1:
        raise ConfigError(f"Mamba layers keep different state sizes ({states})")
    return attn, mamba, (bpts or [0])[-1], (states or [0])[0]


def layer_specs(model: ModelKVConfig, tp_size: int = 1, block_size: int = 16, state_pages: int = 1,
                checkpoint_interval: int | None = None) -> dict[str, KVCacheSpec]:
    """One spec per layer that owns KV memory, all of one block size.

    An attention layer's spec keeps its own bytes per token (its page: `block_size` tokens of
    them; the plan's page is the largest, see `packing`). A Mamba state is much larger than an
    attention page: the block size is raised, in multiples of `block_size`, until `state_pages`
    pages hold a state (vLLM's rule is one page). Besides the checkpoints the manager always
    keeps (each step's last block end, where prompts diverge), a Mamba layer's state is kept
    every `checkpoint_interval` tokens, rounded up to whole blocks (default 0: never; 1: every
    block, vLLM's rule). On a shared-prefix trace periodic checkpoints cost more hits than they
    give: they crowd the cache (`distengine bench kvcache --layout bamba-9b`).
    """
    if tp_size < 1 or block_size < 1 or state_pages < 1:
        raise ConfigError(f"tp size, block size and state pages must be >= 1 "
                          f"(got {tp_size}, {block_size}, {state_pages})")
    attn, mamba, bpt, state = _sizes(model, tp_size)
    specs: dict[str, KVCacheSpec] = {}
    bs = block_size
    if attn and mamba:
        bs = block_size * cdiv(state, state_pages * block_size * bpt)
    page = bs * bpt if attn else state
    for layer in attn:
        specs[layer.name] = _attention_spec(layer, bs, layer.bytes_per_token(tp_size, model.dtype_bytes))
    if mamba:
        pages = cdiv(state, page)
        if checkpoint_interval is not None and checkpoint_interval < 0:
            raise ConfigError(f"mamba_checkpoint_interval must be >= 0 tokens (0: checkpoints only where a step "
                              f"ends or prompts diverge), got {checkpoint_interval}")
        # Rounded up to whole blocks: a state is kept at a block's end.
        interval = cdiv(checkpoint_interval or 0, bs) * bs
        spec = MambaSpec(bs, 0, state_bytes=state, page_bytes=page, pages=pages, checkpoint_interval=interval)
        for layer in mamba:
            specs[layer.name] = spec
    return specs


def vllm_group_size(counts: list[int]) -> int:
    """vLLM's rule: the smallest layer count of any type, or the largest when it is below 1.5x
    the smallest (fewer groups, a little padding)."""
    lo, hi = min(counts), max(counts)
    return hi if hi < 1.5 * lo else lo


Packing = dict[KVCacheSpec, int]  # spec -> layers sharing one page slot (absent: 1)


def packing(specs: dict[str, KVCacheSpec], page_bytes: int, packed: bool) -> Packing:
    """Layers of each attention spec that one page slot holds: with `packed`, as many of its
    pages as fit in the plan's page (`page // own`: every divisor of the largest per-token size
    fills the page; any other ratio packs the most that fit, leaving the rest of the page
    unused); without, one (a whole page each, the rest unused)."""
    return {s: (page_bytes // s.page_size_bytes if packed else 1) for s in set(specs.values())
            if not isinstance(s, MambaSpec)}


def _per_group(spec: KVCacheSpec, g: int, pack: Packing | None = None) -> int:
    """Layers of this spec one group of g slots holds."""
    if isinstance(spec, MambaSpec):
        return g // spec.pages
    return g * (pack or {}).get(spec, 1)


def _int_if_whole(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else round(float(x), 3)


def _evaluate(counts: dict[KVCacheSpec, int], g: int, target_len: int, rule: str,
              pack: Packing | None = None) -> GroupSizeChoice:
    """Padding in pages (a packed group's unused sub-pages count as fractions of a page)."""
    if any(_per_group(s, g, pack) < 1 for s in counts):
        raise ConfigError(f"a group of {g} slots cannot hold a Mamba state of "
                          f"{max(getattr(s, 'pages', 1) for s in counts)} pages")
    groups = {s: cdiv(c, _per_group(s, g, pack)) for s, c in counts.items()}
    pad = {s: Fraction(groups[s] * _per_group(s, g, pack) - c, _per_group(s, 1, pack) or 1)
              if not isinstance(s, MambaSpec) else Fraction(groups[s] * g - c * s.pages)
           for s, c in counts.items()}
    waste = sum((p * s.blocks_held(target_len) for s, p in pad.items()), Fraction(0))
    return GroupSizeChoice(g, sum(groups.values()), _int_if_whole(sum(pad.values(), Fraction(0))),
                           _int_if_whole(waste), rule)


def _request_pages(counts: dict[KVCacheSpec, int], g: int, target_len: int, pack: Packing | None = None) -> int:
    """Pages one request of target_len tokens holds with groups of g slots."""
    return sum(cdiv(c, _per_group(s, g, pack)) * s.blocks_held(target_len) * g for s, c in counts.items())


def choose_group_size(counts: dict[KVCacheSpec, int], target_len: int,
                      max_num_groups: int = DEFAULT_MAX_NUM_GROUPS, pack: Packing | None = None) -> GroupSizeChoice:
    """The group size that wastes the fewest padding pages for one request of `target_len`
    tokens, among those giving at most `max_num_groups` groups; ties go to fewer groups."""
    if len(counts) > max_num_groups:
        raise ConfigError(f"{len(counts)} layer types need at least {len(counts)} groups; "
                          f"max_num_groups is {max_num_groups}")
    best = None
    for g in range(1, max(counts.values()) + 1):
        c = _evaluate(counts, g, target_len, "min padding", pack)
        if c.num_groups > max_num_groups:
            continue
        if best is None or (c.waste_pages, c.num_groups) < (best.waste_pages, best.num_groups):
            best = c
    assert best is not None
    return GroupSizeChoice(best.group_size, best.num_groups, best.padding_slots, best.waste_pages,
                           f"fewest padding pages at {target_len} tokens, at most {max_num_groups} groups")


# Layouts within this fraction of the least memory count as equally small: the finer block wins.
_HYBRID_TOLERANCE = 0.005


def choose_hybrid_layout(model: ModelKVConfig, tp_size: int, block_size: int, target_len: int,
                         max_num_groups: int, checkpoint_interval: int | None,
                         group_size: int | None = None) -> tuple[int, GroupSizeChoice]:
    """(state pages, group size) of an attention + Mamba model: the finest block size among the
    layouts that hold one request of `target_len` tokens in the least memory.

    A state spanning k pages lets the block be k times smaller (finer prefix hits), and needs
    groups of at least k slots; more slots than the attention layers of a type fill costs
    padding. Every (k, slots) pair is tried; `max_num_groups` bounds the attention groups (a
    Mamba layer whose state fills a block is a group of its own).
    """
    attn, mamba, bpt, state = _sizes(model, tp_size)
    top = max(len(attn), len(mamba))
    options = []
    for k in range(1, cdiv(state, block_size * bpt) + 1):
        try:
            specs = layer_specs(model, tp_size, block_size, k, checkpoint_interval)
        except ConfigError:
            continue  # a chunk size this block size does not divide
        counts = Counter(specs.values())
        pages = next(s.pages for s in counts if isinstance(s, MambaSpec))
        if k > 1 and pages < k:
            continue  # the same block size as a smaller k
        bs = next(iter(specs.values())).block_size
        sizes = [group_size] if group_size is not None else range(pages, max(top, pages) + 1)
        for g in sizes:
            if g < pages:
                continue
            c = _evaluate(counts, g, target_len, "")
            attn_groups = sum(cdiv(n, g) for s, n in counts.items() if not isinstance(s, MambaSpec))
            if group_size is None and attn_groups > max_num_groups:
                continue
            options.append((_request_pages(counts, g, target_len) * bs * bpt, bs, c.num_groups, k, c))
    if not options:
        raise ConfigError(f"no layout of this model's attention and Mamba layers fits "
                          f"{'group size ' + str(group_size) if group_size else f'{max_num_groups} groups'}")
    least = min(o[0] for o in options)
    _, bs, _, k, c = min((o for o in options if o[0] <= least * (1 + _HYBRID_TOLERANCE)), key=lambda o: o[1:3])
    rule = ("given" if group_size is not None else
            f"finest block among the layouts holding {target_len} tokens in the least memory")
    return k, GroupSizeChoice(c.group_size, c.num_groups, c.padding_slots, c.waste_pages, rule)


def _vllm_specs(specs: dict[str, KVCacheSpec], page_bytes: int) -> dict[str, KVCacheSpec]:
    """vLLM's unified page size: a smaller attention layer gets a block size as many times larger
    as its page is smaller (`unify_kv_cache_spec_page_size`; it refuses sizes that do not divide)."""
    out = {}
    for name, spec in specs.items():
        if isinstance(spec, MambaSpec) or spec.page_size_bytes == page_bytes:
            out[name] = spec
            continue
        if page_bytes % spec.page_size_bytes:
            raise ConfigError(f"vLLM's layout needs page sizes that divide the largest: {spec.page_size_bytes} B "
                              f"does not divide {page_bytes} B")
        out[name] = spec.with_block_size(spec.block_size * page_bytes // spec.page_size_bytes)
    return out


def _layout_choice(counts: Counter, target_len: int, max_num_groups: int, group_size: int | None,
                   pack: Packing | None, rule: str = "given") -> GroupSizeChoice:
    if group_size is not None:
        if group_size < 1:
            raise ConfigError(f"group size must be >= 1, got {group_size}")
        return _evaluate(counts, group_size, target_len, rule, pack)
    return choose_group_size(counts, target_len, max_num_groups, pack)


def make_plan(model: ModelKVConfig, tp_size: int = 1, block_size: int = 16, max_model_len: int | None = None,
              target_len: int | None = None, max_num_groups: int = DEFAULT_MAX_NUM_GROUPS,
              group_size: int | None = None, state_pages: int | None = None,
              mamba_checkpoint_interval: int | None = None, layout: str | None = None) -> KVCachePlan:
    """`state_pages` forces the pages a Mamba state spans (1: vLLM's layout); by default a
    hybrid model's layout comes from `choose_hybrid_layout`. Attention layers of different
    per-token sizes: `layout` forces PACKED or PADDED pages (VLLM: vLLM's layout, to compare;
    not one our manager runs); by default the one holding a request of `target_len` tokens in
    the least memory (ties: padded)."""
    max_model_len = max_model_len or model.max_model_len
    if max_model_len < 1:
        raise ConfigError(f"max_model_len must be >= 1, got {max_model_len}")
    target_len = target_len or max_model_len
    attn, mamba, _, _ = _sizes(model, tp_size)
    hybrid = bool(attn and mamba)
    k = state_pages or 1
    choice = None
    if hybrid and state_pages is None:
        k, choice = choose_hybrid_layout(model, tp_size, block_size, target_len, max_num_groups,
                                         mamba_checkpoint_interval, group_size)
    specs = layer_specs(model, tp_size, block_size, k, mamba_checkpoint_interval)
    if not specs:
        raise ConfigError(f"{model.name}: no layer keeps KV cache or state")
    page = max(s.page_size_bytes for s in specs.values())
    mixed = len({s.page_size_bytes for s in specs.values() if not isinstance(s, MambaSpec)}) > 1
    if layout not in (None, PACKED, PADDED, VLLM):
        raise ConfigError(f"unknown layout {layout!r} (one of {PACKED}, {PADDED}, {VLLM})")
    vllm_specs = specs
    if mixed and layout in (None, VLLM):
        try:
            vllm_specs = _vllm_specs(specs, page)
        except ConfigError:
            if layout == VLLM:
                raise
            # vLLM cannot run this model: its rule's group size, on our padded pages, to compare.
    if layout == VLLM:
        specs = vllm_specs
    counts = Counter(specs.values())
    base_specs = Counter(vllm_specs.values()) if mixed else (
        counts if k == 1 else Counter(layer_specs(model, tp_size, block_size, 1).values()))
    baseline = _evaluate(base_specs, vllm_group_size(list(base_specs.values())), target_len, "vLLM")
    pack: Packing = {}
    chosen = EQUAL
    if mixed and layout == VLLM:
        chosen = VLLM
        choice = _layout_choice(counts, target_len, max_num_groups, group_size or baseline.group_size, None, "vLLM")
    elif mixed:
        options = []
        for name in ([layout] if layout else [PADDED, PACKED]):
            p = packing(specs, page, name == PACKED)
            c = _layout_choice(counts, target_len, max_num_groups, group_size, p)
            options.append((_request_pages(counts, c.group_size, target_len, p), len(options), name, p, c))
        _, _, chosen, pack, choice = min(options, key=lambda o: o[:2])
        if layout is None and group_size is None:
            choice = GroupSizeChoice(choice.group_size, choice.num_groups, choice.padding_slots, choice.waste_pages,
                                     f"{choice.rule}; {chosen} pages: the least memory at {target_len} tokens")
    elif choice is None:
        choice = _layout_choice(counts, target_len, max_num_groups, group_size, None)
    spec_order = sorted(counts, key=lambda s: (_KIND_ORDER[s.kind], s.describe(), -s.page_size_bytes))
    g = choice.group_size
    groups: list[KVCacheGroup] = []
    layer_slots: dict[str, LayerPlacement] = {}
    for spec in spec_order:
        names = [n for n, s in specs.items() if s == spec]
        pages = getattr(spec, "pages", 1)
        per_slot = pack.get(spec, 1)
        per = _per_group(spec, g, pack)
        for start in range(0, len(names), per):
            chunk = names[start:start + per]
            gid = len(groups)
            positions = [name for name in chunk for _ in range(pages)]
            groups.append(KVCacheGroup(gid, spec, tuple(positions) + (None,) * (g * per_slot - len(positions)),
                                       per_slot))
            for j, name in enumerate(chunk):
                layer_slots[name] = LayerPlacement(gid, (j // per_slot) * pages, j % per_slot)
    shared = {layer.name: layer.kv_sharing_target for layer in model.layers if layer.kv_sharing_target}
    bs = min(s.block_size for s in specs.values())
    return KVCachePlan(model=model.name, tp_size=tp_size, block_size=bs,
                       page_size_bytes=page, num_slots=g, groups=groups,
                       layer_slots=layer_slots, shared_layers=shared, max_model_len=max_model_len,
                       target_len=target_len, choice=choice, baseline=baseline,
                       requested_block_size=block_size, layers=model.layers, dtype_bytes=model.dtype_bytes,
                       state_dtype_bytes=model.state_dtype_bytes,
                       state_pages=k, mamba_checkpoint_interval=mamba_checkpoint_interval,
                       layout=chosen if mixed else EQUAL)


def _model_of(plan: KVCachePlan) -> ModelKVConfig:
    return ModelKVConfig(plan.model, "", plan.layers, plan.dtype_bytes, plan.max_model_len, plan.state_dtype_bytes)


def plan_with_group_size(plan: KVCachePlan, group_size: int, state_pages: int | None = None) -> KVCachePlan:
    """The same model planned with another group size (to compare layouts); `state_pages=1`
    with vLLM's group size is vLLM's layout."""
    return make_plan(_model_of(plan), plan.tp_size, plan.requested_block_size, plan.max_model_len, plan.target_len,
                     group_size=group_size, state_pages=state_pages,
                     mamba_checkpoint_interval=plan.mamba_checkpoint_interval,
                     layout=plan.layout if plan.layout != EQUAL else None)


def vllm_plan(plan: KVCachePlan) -> KVCachePlan:
    """vLLM's layout of the same model: its group-size rule, a Mamba state in one page, kept at
    every block end; attention layers of different per-token sizes on pages of one size, a
    smaller layer's block holding more tokens."""
    return make_plan(_model_of(plan), plan.tp_size, plan.requested_block_size, plan.max_model_len, plan.target_len,
                     group_size=plan.baseline.group_size, state_pages=1, mamba_checkpoint_interval=1,
                     layout=VLLM if plan.mixed_sizes else None)


def layout_plans(plan: KVCachePlan) -> dict[str, KVCachePlan | None]:
    """The layouts to compare for a model whose attention layers keep different per-token sizes
    (packed and padded pages, vLLM's; None where one cannot be built), each with its own group
    size for the plan's target length; empty for the others."""
    if not plan.mixed_sizes:
        return {}
    out: dict[str, KVCachePlan | None] = {}
    for name in (PACKED, PADDED, VLLM):
        if name == plan.layout:
            out[name] = plan
            continue
        try:
            out[name] = (vllm_plan(plan) if name == VLLM else
                         make_plan(_model_of(plan), plan.tp_size, plan.requested_block_size, plan.max_model_len,
                                   plan.target_len, layout=name))
        except ConfigError:
            out[name] = None
    return out
