"""Config reading, grouping, layout and the kv-plan command."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from distengine.model_config import (CHUNKED, FULL, MAMBA, SLIDING, ConfigError, builtin_names,
                                              load_config_dict, parse_model_config)
from distengine.kv_cache.plan import LayerPlacement, make_plan, vllm_group_size
from launch.cli import main
from tests.helpers import plan_of

EXPECTED_KINDS = {
    "llama-3-8b": {FULL: 32}, "qwen3-8b": {FULL: 36}, "mistral-7b": {SLIDING: 32}, "ministral-8b": {SLIDING: 36},
    "gemma-2-9b": {SLIDING: 21, FULL: 21}, "gemma-3-12b": {SLIDING: 40, FULL: 8},
    "gemma-3-27b": {SLIDING: 52, FULL: 10}, "command-a": {SLIDING: 48, FULL: 16},
    "gpt-oss-20b": {SLIDING: 12, FULL: 12}, "gpt-oss-120b": {SLIDING: 18, FULL: 18},
    "llama-4-scout": {CHUNKED: 36, FULL: 12}, "jamba-mini": {MAMBA: 28, FULL: 4}, "bamba-9b": {MAMBA: 29, FULL: 3},
    "granite-4.0-h-tiny": {MAMBA: 36, FULL: 4}, "qwen3.6-27b": {MAMBA: 48, FULL: 16},
    "qwen3.6-35b-a3b": {MAMBA: 30, FULL: 10}, "qwen3-next-80b-a3b": {MAMBA: 36, FULL: 12},
    "gemma-4-31b": {SLIDING: 50, FULL: 10}, "gemma-4-26b-a4b": {SLIDING: 25, FULL: 5},
    "gemma-4-e2b": {SLIDING: 28, FULL: 7}, "nemotron-3-nano-30b-a3b": {MAMBA: 23, FULL: 6},
}


def _parse(name: str, **kw):
    n, cfg = load_config_dict(name)
    return parse_model_config(cfg, n, **kw)


def test_every_builtin_is_there_and_plans():
    assert sorted(EXPECTED_KINDS) == builtin_names()
    for name, kinds in EXPECTED_KINDS.items():
        m = _parse(name)
        assert dict(Counter(layer.kind for layer in m.layers)) == kinds, name
        plan = make_plan(m)
        own = {layer.name for layer in m.layers if not layer.kv_sharing_target}
        slots = {name for g in plan.groups for name in g.layers if name}
        assert slots == own, name
        assert {g.num_slots for g in plan.groups} == {plan.num_slots}  # equal slots per group
        # Each layer sits in exactly one (group, slot, sub-page); shared layers in none.
        assert set(plan.layer_slots) == own and set(plan.shared_layers) | own == {x.name for x in m.layers}


def test_gated_deltanet_state_is_a_state_of_the_plan():
    """Qwen3.6-35B-A3B's Gated DeltaNet layers: conv 3 x (2 x 16 x 128 + 32 x 128) bf16 and the
    recurrent state 32 x 128 x 128 fp32 per layer; planned as states beside attention, with hits
    at a finer block than vLLM's layout (one page per state)."""
    m = _parse("qwen3.6-35b-a3b")
    state = [layer for layer in m.layers if layer.kind == MAMBA]
    assert state[0].state_bytes(1, 2) == 3 * 8192 * 2 + 32 * 128 * 128 * 4 == 2_146_304
    assert state[0].state_bytes(2, 2) == 3 * 4096 * 2 + 16 * 128 * 128 * 4
    plan, vllm = make_plan(m), make_plan(m, state_pages=1)
    assert plan.block_size * 3 <= vllm.block_size
    assert plan.bytes_per_request(plan.max_model_len) <= vllm.bytes_per_request(plan.max_model_len)
    with pytest.raises(ConfigError, match=r"Gated DeltaNet heads \(16 key, 32 value\) are not divisible by tp=32"):
        make_plan(m, tp_size=32)


def test_bamba_block_size_is_raised_to_hold_a_mamba_state():
    # conv 3 x (8192 + 2 x 128) + ssm 128 x 64 x 128 elements, bf16 = 2,147,840 bytes;
    # attention 2 x 8 x 128 x 2 = 4096 bytes/token. vLLM's layout: one page holds a state,
    # 16 x ceil(2147840 / 65536) = 528 tokens.
    vllm = make_plan(_parse("bamba-9b"), state_pages=1)
    assert vllm.block_size == 528 and vllm.page_size_bytes == 528 * 4096
    # Ours: the 3 attention layers fill a group of 3 slots, so a state may span the 3 pages of a
    # block: 16 x ceil(2147840 / (3 x 65536)) = 176 tokens, hits 3x finer, no more memory.
    plan = make_plan(_parse("bamba-9b"))
    assert (plan.block_size, plan.num_slots, plan.state_pages) == (176, 3, 3)
    mamba = [g for g in plan.groups if g.spec.kind == MAMBA]
    assert len(mamba) == 29 and all(g.layers[0] == g.layers[1] == g.layers[2] for g in mamba)
    spec = mamba[0].spec
    assert spec.state_bytes == 2_147_840 and spec.pages == 3 and spec.page_size_bytes == plan.page_size_bytes
    assert spec.checkpoint_interval == 0
    assert make_plan(_parse("bamba-9b"), mamba_checkpoint_interval=200).groups[1].spec.checkpoint_interval == 352
    assert plan.bytes_per_request(4096) <= vllm.bytes_per_request(4096)
    assert plan.bytes_per_request(plan.max_model_len) <= vllm.bytes_per_request(plan.max_model_len)
    for name, place in plan.layer_slots.items():
        assert place.sub_page == 0 and plan.groups[place.group_id].layers[place.slot] == name


def test_group_size_rules():
    assert vllm_group_size([10, 52]) == 10
    assert vllm_group_size([12, 13]) == 13
    # 10 full + 20 sliding: groups of 10, no padding, 3 groups.
    plan = plan_of((FULL, 10), (SLIDING, 20))
    assert (plan.num_slots, len(plan.groups), plan.choice.padding_slots) == (10, 3, 0)
    # The chosen size never wastes more than vLLM's at the target length.
    for name in EXPECTED_KINDS:
        plan = make_plan(_parse(name))
        attention_groups = [g for g in plan.groups if g.spec.kind != MAMBA]
        assert len(attention_groups) <= 16
        if len(attention_groups) == len(plan.groups) and not plan.mixed_sizes:
            # (Layers of different sizes: vLLM's layout has other block sizes, its padding other pages.)
            assert plan.choice.waste_pages <= plan.baseline.waste_pages, name
    # A tighter bound on groups falls back to vLLM's choice for Gemma-3-27B.
    plan = make_plan(_parse("gemma-3-27b"), max_num_groups=8)
    assert (plan.num_slots, plan.choice.padding_slots) == (10, 8)
    with pytest.raises(ConfigError, match="max_num_groups"):
        make_plan(_parse("gemma-3-27b"), max_num_groups=1)


def test_layout_buffers_shared_by_one_layer_of_every_group():
    plan = plan_of((FULL, 3), (SLIDING, 7), group_size=3)
    assert [g.padding for g in plan.groups] == [0, 0, 0, 2]
    for gid, group in enumerate(plan.groups):
        for slot, name in enumerate(group.layers):
            if name:
                assert plan.layer_slots[name] == LayerPlacement(gid, slot)
    assert plan.block_bytes == 3 * plan.page_size_bytes


def test_tensor_parallel_heads_split_or_replicated():
    m = _parse("gpt-oss-20b")  # 8 KV heads of 64
    assert make_plan(m, tp_size=2).page_size_bytes == 16 * 2 * 4 * 64 * 2
    assert make_plan(m, tp_size=16).page_size_bytes == 16 * 2 * 1 * 64 * 2  # replicated
    with pytest.raises(ConfigError, match="tp=3"):
        make_plan(m, tp_size=3)


def test_kv_sharing_layers_read_their_target():
    cfg = {"architectures": ["X"], "model_type": "x", "num_hidden_layers": 6, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512, "sliding_window": 16,
           "layer_types": ["sliding_attention", "full_attention"] * 3, "num_kv_shared_layers": 2}
    plan = make_plan(parse_model_config(cfg))
    assert plan.shared_layers == {"model.layers.4": "model.layers.2", "model.layers.5": "model.layers.3"}
    assert "model.layers.4" not in plan.layer_slots


@pytest.mark.parametrize("cls, kwargs", [
    ("Gemma3TextConfig", {"num_hidden_layers": 13, "sliding_window": 64}),
    ("Cohere2Config", {"num_hidden_layers": 9, "sliding_window": 64}),
    ("Gemma2Config", {"num_hidden_layers": 5, "sliding_window": 64}),
    ("Llama4TextConfig", {"num_hidden_layers": 9, "attention_chunk_size": 64}),
    ("Qwen3Config", {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 64,
                     "max_window_layers": 2}),
])
def test_layer_pattern_matches_transformers(cls, kwargs):
    """The oracle is transformers' own config class: its layer_types, with the field removed from
    what we read (published configs often lack it)."""
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, cls)(**kwargs)
    expected = getattr(config, "layer_types", None)
    if expected is None:
        pytest.skip(f"{cls} has no layer_types in this transformers version")
    d = config.to_dict()
    for key in ("layer_types", "no_rope_layers", "sliding_window_pattern", "_sliding_window_pattern"):
        d.pop(key, None)
    names = {"sliding_attention": SLIDING, "full_attention": FULL, "chunked_attention": CHUNKED}
    assert [layer.kind for layer in parse_model_config(d).layers] == [names[t] for t in expected]


@pytest.mark.parametrize("cfg, message", [
    ({"num_attention_heads": 4, "max_position_embeddings": 8}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "max_position_embeddings": 8}, "num_attention_heads"),
    ({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8}, "max_position_embeddings"),
    ({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "max_position_embeddings": 8,
      "layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
    ({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8, "max_position_embeddings": 8,
      "layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
])
def test_configs_we_cannot_plan_for_say_why(cfg, message):
    with pytest.raises(ConfigError, match=message):
        make_plan(parse_model_config(cfg))


def test_config_path_folder_and_unknown_name(tmp_path):
    _, cfg = load_config_dict("gemma-3-27b")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_config_dict(str(tmp_path))[1] == cfg
    assert load_config_dict(str(tmp_path / "config.json"))[1] == cfg
    with pytest.raises(ConfigError, match="built-in"):
        load_config_dict("no-such-model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        load_config_dict(str(empty))


def test_kv_plan_json(capsys):
    assert main(["kv-plan", "--config", "gemma-3-27b", "--tokens", "8192", "--memory-gib", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["block_size"] == 16 and out["page_size_bytes"] == 131072
    assert out["num_blocks"] == 10 * (1 << 30) // (5 * 131072)
    assert [g["type"] for g in out["groups"]] == ["full_attention"] * 2 + ["sliding_window"] * 11
    assert sum(g["padding"] for g in out["groups"]) == 3
    assert all(len(g["layers"]) == 5 for g in out["groups"])
    assert out["blocks_per_group"] == [512, 512] + [64] * 11


def test_kv_plan_text_for_every_builtin(capsys):
    for name in builtin_names():
        assert main(["kv-plan", "--config", name, "--tokens", "1000"]) == 0
        out = capsys.readouterr().out
        assert "block size" in out and "group size" in out and "capacity at" in out


def test_kv_plan_bad_input_exit_code(capsys):
    assert main(["kv-plan", "--config", "no-such-model"]) == 2
    assert "built-in" in capsys.readouterr().err
    assert main(["kv-plan", "--config", "gpt-oss-20b", "--tp", "3"]) == 2
    assert "tp=3" in capsys.readouterr().err
