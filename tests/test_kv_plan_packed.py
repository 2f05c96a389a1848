"""Attention layers of different per-token sizes (Gemma 4): one block size, packed or padded
pages, vLLM's layout for comparison; Gemma 4's per-layer KV sizes and KV-sharing layers; the
worker's sub-page views and the kernels on them."""
from __future__ import annotations

import json

import pytest
import torch

from distengine.kv_cache.plan import (EQUAL, PACKED, PADDED, VLLM, LayerPlacement, layout_plans, make_plan, vllm_plan)
from distengine.kv_cache.specs import cdiv
from distengine.model_config import FULL, SLIDING, ConfigError, LayerKV, ModelKVConfig, load_config_dict, \
    parse_model_config
from kernels.kv_store import store_kv, store_kv_ref
from kernels.paged_attention import paged_attention
from kernels.paged_attention_ref import paged_attention_ref
from launch.cli import main
from tests.test_paged_attention import make_case, small
from workers.kv_cache import allocate_kv_cache
from workers.layers.attention import Attention

K128 = 131072
GIB = 1 << 30


def _model(*groups: tuple[str, int, int, int], window: int = 32, max_len: int = 1 << 16,
           dtype_bytes: int = 2) -> ModelKVConfig:
    """(kind, count, kv heads, head dim) per run of layers."""
    layers, i = [], 0
    for kind, count, heads, dim in groups:
        for _ in range(count):
            layers.append(LayerKV(f"model.layers.{i}", kind, heads, dim, window=window if kind == SLIDING else 0))
            i += 1
    return ModelKVConfig("mixed", "Test", tuple(layers), dtype_bytes, max_len)


def _gemma4(name: str):
    n, cfg = load_config_dict(name)
    return parse_model_config(cfg, n)


# -- the plan ----------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", [2, 4])
@pytest.mark.parametrize("tp", [1, 2])
def test_packed_pages_hold_ratio_layers_per_slot(ratio, tp):
    # 12 sliding layers of 4 heads x 32; 8 full layers of 4 heads x (32 / ratio): per token
    # 512 B against 512 / ratio B (halved on 2 ranks). Full layers dominate a long request, so
    # packing them r to a page beats giving each a whole page.
    m = _model((SLIDING, 12, 4, 32), (FULL, 8, 4, 32 // ratio))
    plan = make_plan(m, tp_size=tp, target_len=4096)
    big = 2 * (4 // tp) * 32 * 2
    assert plan.layout == PACKED and plan.block_size == 16 and plan.page_size_bytes == 16 * big
    full = [g for g in plan.groups if g.spec.kind == FULL]
    assert all(g.per_slot == ratio and g.spec.page_size_bytes == plan.page_size_bytes // ratio for g in full)
    assert all(g.per_slot == 1 for g in plan.groups if g.spec.kind == SLIDING)
    # Every layer in exactly one (group, slot, sub-page); a packed group's slot j holds its
    # positions j*r .. j*r + r - 1.
    seen = set()
    for name, place in plan.layer_slots.items():
        g = plan.groups[place.group_id]
        assert g.layers[place.slot * g.per_slot + place.sub_page] == name
        assert 0 <= place.sub_page < g.per_slot and place.slot < plan.num_slots
        seen.add((place.group_id, place.slot, place.sub_page))
    assert len(seen) == len(plan.layer_slots) == 20
    # Bytes per request, by hand: blocks held x the group's slots x the page, per group.
    by_hand = sum(g.spec.blocks_held(4096) * plan.num_slots * plan.page_size_bytes for g in plan.groups)
    assert plan.bytes_per_request(4096) == by_hand
    full_bytes = sum(g.spec.blocks_held(4096) * plan.num_slots * plan.page_size_bytes
                     for g in plan.groups if g.spec.kind == FULL)
    if plan.choice.padding_slots == 0:
        assert full_bytes == 8 * cdiv(4096, 16) * 16 * big // ratio  # exactly their own K/V
    padded = make_plan(m, tp_size=tp, target_len=4096, layout=PADDED)
    assert padded.layout == PADDED and all(g.per_slot == 1 for g in padded.groups)
    assert plan.bytes_per_request(4096) < padded.bytes_per_request(4096)
    vllm = vllm_plan(plan)
    assert vllm.layout == VLLM and sorted({g.spec.block_size for g in vllm.groups}) == [16, 16 * ratio]
    assert plan.choice.padding_slots == 0
    assert plan.bytes_per_request(4096) <= vllm.bytes_per_request(4096)


def test_an_odd_count_of_packed_layers_leaves_part_of_a_page():
    """5 full layers two to a page fill 2.5 page slots: whatever the group size, half a page per
    block stays unused. vLLM's layout (the full layers' blocks 32 tokens) holds no such padding;
    our packed pages still beat padded ones."""
    m = _model((SLIDING, 25, 4, 32), (FULL, 5, 2, 32), window=1024)
    plan = make_plan(m, max_model_len=K128)
    assert plan.layout == PACKED
    full = [g for g in plan.groups if g.spec.kind == FULL]
    assert sum(g.padding for g in full) % 2 == 1
    page = plan.page_size_bytes
    assert plan.choice.waste_pages >= 0.5 * cdiv(K128, 16)
    vllm, padded = vllm_plan(plan), make_plan(m, max_model_len=K128, layout=PADDED)
    assert vllm.bytes_per_request(K128) < plan.bytes_per_request(K128) < padded.bytes_per_request(K128)
    # The gap is that half page per block (and the sliding groups' padding).
    gap = plan.bytes_per_request(K128) - vllm.bytes_per_request(K128)
    assert gap >= page // 2 * cdiv(K128, 16)


def test_group_padding_with_packed_pages():
    # 5 full layers packed 2 to a page in groups of 2 slots: 2 groups of 4 positions, 3 unused
    # positions = 1.5 pages of padding.
    m = _model((SLIDING, 4, 4, 32), (FULL, 5, 4, 16))
    plan = make_plan(m, target_len=1024, group_size=2, layout=PACKED)
    full = [g for g in plan.groups if g.spec.kind == FULL]
    assert [g.layers.count(None) for g in full] == [0, 3] and [g.num_slots for g in full] == [2, 2]
    assert plan.choice.padding_slots == 1.5
    assert plan.choice.waste_pages == 1.5 * cdiv(1024, 16)
    # The group size chosen by default wastes no more than this one.
    best = make_plan(m, target_len=1024, layout=PACKED)
    assert best.choice.waste_pages <= plan.choice.waste_pages
    assert best.bytes_per_request(1024) <= plan.bytes_per_request(1024)


def test_padding_chosen_when_packing_saves_nothing():
    # Sizes 3 : 2 (heads 3 and 2 of 32): one smaller page fits in the larger, packing and
    # padding are the same layout; ties go to padding.
    m = _model((SLIDING, 3, 3, 32), (FULL, 3, 2, 32))
    plan = make_plan(m, target_len=1024)
    assert plan.layout == PADDED and all(g.per_slot == 1 for g in plan.groups)
    assert layout_plans(plan)[VLLM] is None  # vLLM refuses page sizes that do not divide


def test_ratio_that_does_not_divide_packs_what_fits():
    # 5 : 2 -> two sub-pages in a page, the last fifth unused.
    m = _model((SLIDING, 2, 5, 32), (FULL, 8, 2, 32))
    plan = make_plan(m, target_len=8192)
    full = [g for g in plan.groups if g.spec.kind == FULL]
    assert plan.layout == PACKED and all(g.per_slot == 2 for g in full)
    assert 2 * full[0].spec.page_size_bytes < plan.page_size_bytes
    assert plan.bytes_per_request(8192) < make_plan(m, target_len=8192, layout=PADDED).bytes_per_request(8192)


def test_mixed_sizes_beside_mamba_are_refused():
    from distengine.model_config import MAMBA, MambaShape
    layers = (LayerKV("a", FULL, 2, 16), LayerKV("b", FULL, 2, 32), LayerKV("c", MAMBA, mamba=MambaShape(1, 16, 4, 4)))
    with pytest.raises(ConfigError, match="beside Mamba"):
        make_plan(ModelKVConfig("x", "X", layers, 2, 1024))


@pytest.mark.parametrize("tp, ours_gib", [(1, 10.78125), (2, 5.390625)])
def test_gemma4_31b_at_128k_holds_no_more_than_vllms_layout(tp, ours_gib):
    m = _gemma4("gemma-4-31b")
    sliding = [layer for layer in m.layers if layer.kind == SLIDING]
    full = [layer for layer in m.layers if layer.kind == FULL]
    assert (len(sliding), len(full)) == (50, 10)
    assert {(x.num_kv_heads, x.head_dim, x.window) for x in sliding} == {(16, 256, 1024)}
    assert {(x.num_kv_heads, x.head_dim) for x in full} == {(4, 512)}
    assert sliding[0].bytes_per_token(1, 2) == 16384 and full[0].bytes_per_token(1, 2) == 8192
    plan = make_plan(m, tp_size=tp, max_model_len=K128)
    assert plan.layout == PACKED and plan.block_size == 16
    ours, vllm = plan.bytes_per_request(K128), vllm_plan(plan).bytes_per_request(K128)
    assert ours <= vllm
    assert ours == ours_gib * GIB
    layouts = {k: p.bytes_per_request(K128) for k, p in layout_plans(plan).items()}
    assert layouts[PACKED] == ours and layouts[PADDED] > ours and layouts[VLLM] == vllm
    # The full layers hold exactly their K/V: 10 x 8 KiB x 128k / tp; the sliding layers their window.
    assert ours - 10 * 8192 * K128 // tp == 50 * 64 * 16 * 16384 // tp


def test_gemma4_26b_and_e2b_plan():
    moe = make_plan(_gemma4("gemma-4-26b-a4b"), max_model_len=K128)
    full = [layer for layer in moe.layers if layer.kind == FULL]
    assert {(x.num_kv_heads, x.head_dim) for x in full} == {(2, 512)}  # 4 KiB against 8 KiB sliding
    assert moe.layout == PACKED and {g.per_slot for g in moe.groups if g.spec.kind == FULL} == {2}
    # 5 full layers: an odd count two to a page (see above); vLLM's layout holds less here.
    padded = make_plan(_gemma4("gemma-4-26b-a4b"), max_model_len=K128, layout=PADDED)
    assert moe.bytes_per_request(K128) < padded.bytes_per_request(K128)
    e2b = make_plan(_gemma4("gemma-4-e2b"), max_model_len=K128)
    # No k_eq_v: the full layers keep 1 KV head, of 512: 2 KiB, the sliding ones 1 KiB.
    assert {(x.kind, x.bytes_per_token(1, 2)) for x in e2b.layers} == {(FULL, 2048), (SLIDING, 1024)}
    assert len(e2b.shared_layers) == 20 and len(e2b.layer_slots) == 15
    assert e2b.bytes_per_request(K128) <= vllm_plan(e2b).bytes_per_request(K128)


def test_kv_plan_cli_gemma4_31b(capsys):
    args = ["kv-plan", "--config", "gemma-4-31b", "--max-model-len", str(K128), "--tokens", str(K128)]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == PACKED and out["page_size_bytes"] == 16 * 16384
    layouts = out["layouts_bytes_per_request"]
    assert layouts[PACKED] == out["bytes_per_request"] <= layouts[VLLM] == out["vllm_rule_bytes_per_request"]
    assert layouts[PADDED] > layouts[PACKED] and out["uniform_bytes_per_request"] == 60 * 16384 * K128 - 10 * 8192 * K128
    full = [g for g in out["groups"] if g["type"] == "full_attention"]
    assert full and all(g["layers_per_slot"] == 2 and g["sub_page_bytes"] == 16 * 8192 for g in full)
    assert main(args + ["--tp", "2"]) == 0
    text = capsys.readouterr().out
    assert "layout: packed pages" in text and "layers 5+11" in text
    assert "packed pages (chosen) 5.4 GiB" in text and "padded pages 10.4 GiB" in text
    assert "vLLM's layout 5.4 GiB" in text and "block size 16/32" in text
    assert "ours / vLLM's layout: 1.000" in text


# -- Gemma 4 config reading --------------------------------------------------------------------

def _tiny(**kw):
    return dict(dict(num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                     global_head_dim=64, num_global_key_value_heads=2, sliding_window=16), **kw)


@pytest.mark.parametrize("kw", [
    dict(attention_k_eq_v=True), dict(attention_k_eq_v=False), dict(attention_k_eq_v=True, num_kv_shared_layers=4),
    dict(num_hidden_layers=8, num_kv_shared_layers=2),  # a sliding last layer: forced full
])
@pytest.mark.parametrize("form", ["raw", "saved", "nested"])
def test_gemma4_layers_match_transformers(kw, form):
    """The oracle: Gemma4TextConfig's per_layer_config, layer_types and kv_sharing_modes (a
    "reuse" layer reads the last non-shared layer of its type, the "store" one)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma4TextConfig(**_tiny(**kw))
    raw = dict(_tiny(**kw), model_type="gemma4_text", max_position_embeddings=1024)
    d = {"raw": raw, "saved": config.to_dict(),
         "nested": {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": raw}}[form]
    m = parse_model_config(d)
    modes = config.kv_sharing_modes
    store = {config.layer_types[i]: f"model.layers.{i}" for i, mode in enumerate(modes) if mode == "store"}
    kinds = {"sliding_attention": SLIDING, "full_attention": FULL}
    assert len(m.layers) == config.num_hidden_layers
    for i, layer in enumerate(m.layers):
        per = config.per_layer_config[i]
        assert (layer.kind, layer.num_kv_heads, layer.head_dim) == (kinds[config.layer_types[i]],
                                                                     per.num_key_value_heads, per.head_dim), i
        assert layer.kv_sharing_target == (store[config.layer_types[i]] if modes[i] == "reuse" else None), i
    plan = make_plan(m)
    shared = {f"model.layers.{i}" for i, mode in enumerate(modes) if mode == "reuse"}
    assert set(plan.shared_layers) == shared and not shared & set(plan.layer_slots)
    assert set(plan.layer_slots) | shared == {layer.name for layer in m.layers}


def test_gemma4_sharing_without_a_producer_of_the_type_is_refused():
    # 12 layers, 7 shared: layers 0-4 are all sliding, so no full layer keeps K/V to reuse
    # (transformers refuses this config too).
    with pytest.raises(ConfigError, match="no earlier full_attention layer"):
        parse_model_config(dict(_tiny(num_kv_shared_layers=7), model_type="gemma4_text", max_position_embeddings=64))


def test_gemma4_explicit_per_layer_config_and_defaults():
    cfg = {"model_type": "gemma4_text", "num_hidden_layers": 4, "num_attention_heads": 4,
           "layer_types": ["sliding_attention", "full_attention"] * 2,
           "per_layer_config": {"01": {"head_dim": 128}, "3": {"head_dim": 96, "num_key_value_heads": 1}}}
    m = parse_model_config(cfg)  # head_dim 256, 4 KV heads, window 512: Gemma4TextConfig's defaults
    assert [(x.num_kv_heads, x.head_dim) for x in m.layers] == [(4, 256), (4, 128), (4, 256), (1, 96)]
    assert m.layers[0].window == 512 and m.max_model_len == 131072
    # No per_layer_config: the full layers take global_head_dim's default, 512.
    m = parse_model_config({k: v for k, v in cfg.items() if k != "per_layer_config"})
    assert [x.head_dim for x in m.layers] == [256, 512, 256, 512]
    with pytest.raises(ConfigError, match="per_layer_config names layer 9"):
        parse_model_config(dict(cfg, per_layer_config={"9": {"head_dim": 8}}))


def test_gemma4_tp_splits_heads_per_layer():
    m = _gemma4("gemma-4-26b-a4b")  # 8 sliding KV heads, 2 global
    full = next(x for x in m.layers if x.kind == FULL)
    assert full.bytes_per_token(2, 2) == 2 * 1 * 512 * 2
    assert full.bytes_per_token(4, 2) == 2 * 1 * 512 * 2  # replicated: fewer heads than ranks
    assert make_plan(m, tp_size=2, max_model_len=K128).layout == PACKED  # 4 KiB sliding, 2 KiB full
    assert make_plan(m, tp_size=4, max_model_len=K128).layout == EQUAL  # 2 KiB both
    with pytest.raises(ConfigError, match="tp=3"):
        make_plan(m, tp_size=3)


def test_gemma4_architectures_are_served_by_the_gemma4_model():
    from workers.models import get_model_class
    from workers.models.gemma4 import Gemma4ForCausalLM
    for arch in ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"):
        assert get_model_class([arch]) is Gemma4ForCausalLM


# -- allocation and kernels on sub-page views --------------------------------------------------

def _allocated(plan, num_blocks=5, dtype=torch.float32):
    layers = {layer.name: Attention(2 * layer.num_kv_heads, layer.num_kv_heads, layer.head_dim, 1.0, layer.name)
              for layer in plan.layers}
    pool = allocate_kv_cache(plan, layers, num_blocks, dtype, torch.device("cpu"))
    return pool, layers


def test_packed_views_alias_only_their_own_sub_page():
    """Through a layer's view, block b's K/V are its sub-page of its slot's page in block b and
    nothing else (layers of other groups use the same page slots under other block ids)."""
    m = _model((SLIDING, 2, 2, 16), (FULL, 3, 1, 16), (FULL, 1, 2, 16))
    m = ModelKVConfig(m.name, m.architecture, m.layers + (
        LayerKV("model.layers.6", FULL, 1, 16, kv_sharing_target="model.layers.3"),), 2, m.max_model_len)
    plan = make_plan(m, target_len=4096, layout=PACKED, group_size=2)
    assert plan.page_size_bytes == 16 * 2 * 2 * 16 * 2 and plan.num_slots == 2
    packed = [n for n, p in plan.layer_slots.items() if plan.groups[p.group_id].per_slot == 2]
    assert sorted(packed) == ["model.layers.2", "model.layers.3", "model.layers.4"]
    assert [plan.layer_slots[n] for n in packed] == [LayerPlacement(plan.layer_slots[packed[0]].group_id, s, sub)
                                                     for s, sub in ((0, 0), (0, 1), (1, 0))]
    pool, layers = _allocated(plan, dtype=torch.bfloat16)
    assert layers["model.layers.6"].kv_cache.data_ptr() == layers["model.layers.3"].kv_cache.data_ptr()
    for name, place in plan.layer_slots.items():
        kv = layers[name].kv_cache
        assert kv.shape == (5, 2, 16, layers[name].num_kv_heads, 16) and kv.stride(-1) == 1
        sub = plan.groups[place.group_id].spec.page_size_bytes
        for b in (1, 4):
            kv[b].fill_(1.0)
            expect = torch.zeros_like(pool, dtype=torch.bool)
            expect[b, place.slot, place.sub_page * sub:(place.sub_page + 1) * sub] = True
            assert torch.equal(pool != 0, expect), (name, b)
            same_group = [n for n, p in plan.layer_slots.items() if p.group_id == place.group_id and n != name]
            assert all(not layers[n].kv_cache.any() for n in same_group)
            kv[b].zero_()


def test_padded_view_is_the_start_of_its_page():
    m = _model((SLIDING, 1, 2, 16), (FULL, 1, 1, 16), dtype_bytes=4)
    plan = make_plan(m, target_len=64, layout=PADDED)
    pool, layers = _allocated(plan)
    layers["model.layers.1"].kv_cache.fill_(1.0)
    place = plan.layer_slots["model.layers.1"]
    used = pool[:, place.slot].view(torch.float32)
    assert used[:, : used.shape[1] // 2].eq(1).all() and used[:, used.shape[1] // 2:].eq(0).all()


@pytest.mark.parametrize("use_kernels", [False, True])
def test_store_and_attention_on_a_sub_page_equal_a_standalone_cache(use_kernels):
    """K/V stored through a packed layer's sub-page view, then attended: the same as on a cache
    of its own (the torch references; the Triton kernels under the interpreter)."""
    num_q, num_kv, head_dim, bs = 4, 1, 32, 16
    m = _model((SLIDING, 1, 2, head_dim), (FULL, 2, num_kv, head_dim), dtype_bytes=4)
    plan = make_plan(m, target_len=4096, layout=PACKED)
    full = [n for n, p in plan.layer_slots.items() if plan.groups[p.group_id].per_slot == 2]
    view_layer = next(n for n in full if plan.layer_slots[n].sub_page == 1)  # offset inside the page
    args, g = make_case([(0, 19), (37, 1)], num_q, num_kv, head_dim, bs, torch.float32, seed=3)
    nb = args["kv_cache"].shape[0]
    pool, layers = _allocated(plan, num_blocks=nb)
    pool.copy_(torch.randint(0, 255, pool.shape, generator=g, dtype=torch.uint8))  # neighbours hold garbage
    view = layers[view_layer].kv_cache
    standalone = torch.zeros_like(args["kv_cache"])
    # Store the cached context and the new tokens alike: every position of each sequence.
    lens = args["seq_lens"].tolist()
    slots = torch.cat([args["block_table"][s, torch.arange(L) // bs].long() * bs + torch.arange(L) % bs
                       for s, L in enumerate(lens)])
    k = torch.randn(len(slots), num_kv, head_dim, generator=g)
    v = torch.randn(len(slots), num_kv, head_dim, generator=g)
    store = store_kv if use_kernels else store_kv_ref
    neighbours = pool.clone()
    store(k, v, view, slots)
    store_kv_ref(k, v, standalone, slots)
    written = torch.zeros_like(pool, dtype=torch.bool)
    place = plan.layer_slots[view_layer]
    sub = plan.groups[place.group_id].spec.page_size_bytes
    written[:, place.slot, place.sub_page * sub:(place.sub_page + 1) * sub] = True
    assert torch.equal(pool[~written], neighbours[~written])  # nothing outside its sub-page moved
    blk, off = slots // bs, slots % bs
    assert torch.equal(view[:, 0][blk, off], k) and torch.equal(view[:, 1][blk, off], v)
    attend = (lambda **a: paged_attention(**a, config=small(num_q // num_kv))) if use_kernels else paged_attention_ref
    out_view = attend(**dict(args, kv_cache=view))
    out_alone = attend(**dict(args, kv_cache=standalone))
    torch.testing.assert_close(out_view, out_alone, rtol=0, atol=0)


def test_manager_runs_a_packed_plan_with_prefix_hits_at_the_block_size():
    """Packing changes where a layer's bytes sit, not the block tables: one block size, prefix
    hits in blocks of 16 tokens for every group, KV-sharing layers holding no blocks."""
    from distengine.request import Request
    from tests.helpers import admit, held, manager
    plan = make_plan(_gemma4("gemma-4-e2b"), max_model_len=4096)
    assert plan.layout == PACKED and plan.block_size == 16
    mgr = manager(plan, num_blocks=200)
    a = Request("a", list(range(100)))
    assert admit(mgr, a)[1] == 0
    assert held(mgr, "a") == [g.spec.blocks_held(100) for g in plan.groups]
    b = Request("b", list(range(96)) + [999] * 4)
    _, hit = admit(mgr, b)
    assert hit == 96  # 6 blocks of 16 tokens from a's
