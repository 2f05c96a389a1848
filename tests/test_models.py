"""Our models against Hugging Face transformers on the same tiny random weights: prefill logits
(float32), 32 greedy tokens, chunked prefill and prefix-cache hits through the paged cache."""
from __future__ import annotations

import pytest
import torch

import tempfile

from tests.conftest import DEVICE
from tests.model_harness import Harness
from workers.loader import load_model
from workers.models import get_model_class
from workers.parallel import TPGroup

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512)
# eos_token_id=None for the three below: their default ids (1 for Gemma, out of the vocabulary for
# Cohere) would end HF's generate() early on some prompts, or warn.
CONFIGS = {
    "llama": ("LlamaConfig", "workers.models.llama:LlamaForCausalLM",
              dict(num_hidden_layers=3, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "workers.models.mistral:MistralForCausalLM",
                dict(num_hidden_layers=3, sliding_window=12)),
    "qwen2": ("Qwen2Config", "workers.models.qwen2:Qwen2ForCausalLM",
              dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=12, max_window_layers=2)),
    "qwen3": ("Qwen3Config", "workers.models.qwen3:Qwen3ForCausalLM", dict(num_hidden_layers=3)),
    # Alternating sliding/full (sliding first); caps small enough that the tanh bends the scores
    # and the logits of these tiny random weights; eager attention, the one HF soft-caps in.
    "gemma2": ("Gemma2Config", "workers.models.gemma2:Gemma2ForCausalLM",
               dict(num_hidden_layers=4, sliding_window=12, query_pre_attn_scalar=24, attn_logit_softcapping=0.25,
                    final_logit_softcapping=1.0, attn_implementation="eager", eos_token_id=None)),
    # 5 sliding : 1 full, each type its own RoPE base (the full one linearly scaled, as the 4B+ models).
    "gemma3": ("Gemma3TextConfig", "workers.models.gemma3:Gemma3ForCausalLM",
               dict(num_hidden_layers=6, sliding_window=12, sliding_window_pattern=6, query_pre_attn_scalar=24,
                    eos_token_id=None,
                    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                     "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                        "rope_theta": 1000000.0}})),
    # 3 sliding (with interleaved RoPE) : 1 full (no RoPE), parallel block, LayerNorm, logit_scale;
    # larger init so that the greedy continuation does not collapse onto a few repeated tokens.
    "cohere2": ("Cohere2Config", "workers.models.cohere2:Cohere2ForCausalLM",
                dict(num_hidden_layers=4, sliding_window=12, initializer_range=0.1, eos_token_id=None)),
    # Mamba-2 hybrids. Bamba: one B/C group, as Bamba-9B (at TP=2 the gated norm's groups span
    # both ranks), partial rotary; 8 heads of 16, 16 states.
    "bamba": ("BambaConfig", "workers.models.bamba:BambaForCausalLM",
              dict(num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                   mamba_n_groups=1, mamba_chunk_size=16, eos_token_id=None, initializer_range=0.1)),
    # Nemotron-H: Mamba, attention (no RoPE), relu2 MLP-only layers; 2 B/C groups (split across
    # 2 ranks), in/out_proj biases (use_bias).
    "nemotron_h": ("NemotronHConfig", "workers.models.nemotron_h:NemotronHForCausalLM",
                   dict(hybrid_override_pattern="M*-M-", mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
                        n_groups=2, conv_kernel=4, chunk_size=16, use_bias=True, mlp_bias=True, eos_token_id=None,
                        initializer_range=0.15, rescale_prenorm_residual=False)),
    # ...and its routed experts ("E"): 8 ungated relu2 experts in 4 groups of which 2 are kept, a
    # shared expert of 1.5 experts' width (at TP=2: two slots, the second half padding), the weights
    # renormalised and scaled; `build` gives the router a correction bias large enough to move the
    # choice.
    "nemotron_h_moe": ("NemotronHConfig", "workers.models.nemotron_h:NemotronHForCausalLM",
                       dict(hybrid_override_pattern="ME*-EM", mamba_num_heads=8, mamba_head_dim=16,
                            ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16, eos_token_id=None,
                            initializer_range=0.15, rescale_prenorm_residual=False, n_routed_experts=8,
                            num_experts_per_tok=3, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                            n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    # Falcon-H1: attention and Mamba side by side in every layer; every muP multiplier away from 1;
    # mamba_d_ssm (96) != expand * hidden; no gated norm (y * silu(z)); 2 B/C groups; both biases.
    "falcon_h1": ("FalconH1Config", "workers.models.falcon_h1:FalconH1ForCausalLM",
                  dict(num_hidden_layers=3, mamba_n_heads=8, mamba_d_head=12, mamba_d_ssm=96, mamba_n_groups=2,
                       mamba_d_state=16, mamba_chunk_size=16, mamba_proj_bias=True, projectors_bias=True,
                       attention_in_multiplier=0.8, key_multiplier=0.7, attention_out_multiplier=1.2,
                       ssm_in_multiplier=1.3, ssm_out_multiplier=0.9, ssm_multipliers=[0.8, 1.2, 0.9, 1.1, 1.5],
                       mlp_multipliers=[1.3, 0.8], embedding_multiplier=1.5, lm_head_multiplier=0.7,
                       eos_token_id=None, initializer_range=0.2)),
    # ...and with the gated norm after the gate (norm_before_gate), one B/C group (replicated at
    # TP=2, the norm's group spanning both ranks), d_head "auto", tied embeddings.
    "falcon_h1_norm": ("FalconH1Config", "workers.models.falcon_h1:FalconH1ForCausalLM",
                       dict(num_hidden_layers=2, mamba_n_heads=8, mamba_d_ssm=None, mamba_n_groups=1,
                            mamba_d_state=16, mamba_chunk_size=16, mamba_rms_norm=True, mamba_norm_before_gate=True,
                            attention_in_multiplier=1.1, key_multiplier=0.6, attention_out_multiplier=0.8,
                            ssm_in_multiplier=0.7, ssm_out_multiplier=1.4, ssm_multipliers=[1.2, 0.9, 1.1, 0.8, 0.6],
                            mlp_multipliers=[0.8, 1.25], embedding_multiplier=0.8, lm_head_multiplier=1.3,
                            tie_word_embeddings=True, eos_token_id=None, initializer_range=0.1)),
    # Granite-4.0-H, dense (no routed experts): shared MLP, RoPE, one B/C group, Granite's
    # embedding / residual / attention multipliers and logits scaling.
    "granitemoehybrid": ("GraniteMoeHybridConfig", "workers.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
                         dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
                              num_local_experts=0, shared_intermediate_size=96, position_embedding_type="rope",
                              mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
                              mamba_chunk_size=16, attention_bias=True, embedding_multiplier=3.0,
                              residual_multiplier=0.6, attention_multiplier=0.1, logits_scaling=2.5,
                              eos_token_id=None, initializer_range=0.2)),
    # Granite-4.0-H with routed experts (Tiny / Small): 6 experts, 2 per token, beside the shared
    # MLP; NoPE and one B/C group as the released models (transformers up to 5.17 normalises the
    # gated norm over all groups at once, later versions per group, as we do). A larger init
    # spreads the router's logits, so that no top-k choice rests on a near tie between experts.
    "granitemoehybrid_moe": ("GraniteMoeHybridConfig", "workers.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
                             dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
                                  num_local_experts=6, num_experts_per_tok=2, shared_intermediate_size=64,
                                  position_embedding_type="nope", mamba_n_heads=8,
                                  mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16,
                                  embedding_multiplier=2.0, residual_multiplier=0.7, attention_multiplier=0.2,
                                  logits_scaling=1.5, eos_token_id=None, initializer_range=0.2)),
    # Jamba: Mamba-1 (with its dt/B/C norms, a conv bias and in/out_proj biases) and attention (no
    # RoPE) layers; 4 experts, 2 per token, their weights not renormalised, on layers 0 and 2, the
    # gated MLP on 1 and 3; dt rank 8 != hidden / 16; a larger init spreads the router's logits.
    "jamba": ("JambaConfig", "workers.models.jamba:JambaForCausalLM",
              dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                   expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
                   mamba_expand=2, mamba_dt_rank=8, mamba_proj_bias=True, mamba_conv_bias=True,
                   eos_token_id=None, initializer_range=0.1)),
    # gpt-oss: sliding (window 12) and full layers alternating, attention sinks, q/k/v/o biases,
    # YaRN; 4 experts, 2 per token, with biases and the clamped activation (a limit small enough
    # that the clamps bind on these weights).
    "gpt_oss": ("GptOssConfig", "workers.models.gpt_oss:GptOssForCausalLM",
                dict(num_hidden_layers=4, sliding_window=12, num_local_experts=4, num_experts_per_tok=2,
                     swiglu_limit=1.5, eos_token_id=None, initializer_range=0.1,
                     rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "truncate": False, "original_max_position_embeddings": 128,
                                      "rope_theta": 150000.0})),
}
# Llama-4: chunks of 8 (a 40-token prompt crosses five), RoPE (chunked, qk L2 norm, llama3
# scaling) and NoPE (global, temperature tuning with floor_scale 4, so that the query scale
# changes every few positions) layers mixed, experts on every other layer (4 experts, 1 per token,
# score on the input, a shared expert) and a dense MLP of its own width on the others; a larger
# init spreads the router's logits, so that no top-1 choice rests on a near tie.
LLAMA4 = dict(num_hidden_layers=4, no_rope_layers=[1, 0, 1, 1], attention_chunk_size=8, interleave_moe_layer_step=2,
              num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=96, floor_scale=4, attn_scale=0.5,
              eos_token_id=None, initializer_range=0.1,
              rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 16, "rope_theta": 500000.0})
LLAMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                     patch_size=8, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
CONFIGS.update({
    "llama4": ("Llama4TextConfig", "workers.models.llama4:Llama4ForCausalLM", LLAMA4),
    # The published multimodal checkpoint (language_model.model.*, the vision tower unread); two
    # experts per token and experts on every layer (moe_layers), a NoPE layer first.
    "llama4_vl": ("Llama4Config", "workers.models.llama4:Llama4ForCausalLM",
                  dict(text_config={**LLAMA4, "no_rope_layers": [0, 1, 1, 0], "num_experts_per_tok": 2,
                                    "moe_layers": [0, 1, 2, 3]},
                       vision_config=LLAMA4_VISION)),
})
# Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): linear-attention and gated full-attention layers;
# 2 key heads of 16 serving 4 value heads of 24 (Hv = 2 Hk, K != V); partial rotary (4 of the 16
# dims of a head); a larger init spreads the routers' logits, so that no top-k choice rests on a
# near tie between experts.
DELTANET = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                                   "linear_attention"],
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24,
                linear_conv_kernel_dim=4, eos_token_id=None, initializer_range=0.1)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
CONFIGS.update({
    # Experts with a shared expert on layers 0, 2, 3 and an MLP on layer 1 (mlp_only_layers); the
    # top-k weights not renormalised (norm_topk_prob off, the released models' is on: Qwen3.5-MoE
    # below renormalises).
    "qwen3_next": ("Qwen3NextConfig", "workers.models.qwen3_next:Qwen3NextForCausalLM",
                   dict(**DELTANET, **EXPERTS, mlp_only_layers=[1], norm_topk_prob=False)),
    "qwen3_5": ("Qwen3_5TextConfig", "workers.models.qwen3_5:Qwen3_5ForCausalLM", DELTANET),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "workers.models.qwen3_5:Qwen3_5MoeForCausalLM", {**DELTANET, **EXPERTS}),
    # The published multimodal checkpoints, whose text part we serve (the vision tower unread);
    # the dense one with its embeddings tied by the wrapper's tie_word_embeddings.
    "qwen3_5_vl": ("Qwen3_5Config", "workers.models.qwen3_5:Qwen3_5ForCausalLM",
                   dict(text_config=DELTANET, vision_config=VISION, tie_word_embeddings=True)),
    "qwen3_5_moe_vl": ("Qwen3_5MoeConfig", "workers.models.qwen3_5:Qwen3_5MoeForCausalLM",
                       dict(text_config={**DELTANET, **EXPERTS}, vision_config=VISION)),
})
# Gemma 4: 4 sliding (head 16, 2 KV heads) and 2 full layers (head 32, 1 KV head: k_eq_v, values
# from the key projection), proportional RoPE on a quarter of the full heads; per-layer inputs of 8;
# the last 2 layers (one of each type) read the K/V of layers 3 and 1 with a double-wide MLP;
# final-logit soft-capping small enough to bend the logits.
GEMMA4 = dict(num_hidden_layers=6, layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                 "sliding_attention", "sliding_attention", "full_attention"],
              sliding_window=12, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
              hidden_size_per_layer_input=8, vocab_size_per_layer_input=300, num_kv_shared_layers=2,
              use_double_wide_mlp=True, final_logit_softcapping=2.0, eos_token_id=None,
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                  "rope_theta": 1000000.0}})
CONFIGS.update({
    "gemma4": ("Gemma4TextConfig", "workers.models.gemma4:Gemma4ForCausalLM", GEMMA4),
    # The published multimodal checkpoint (model.language_model.*, the vision tower unread); no
    # KV sharing, full layers with their own v_proj (k_eq_v off: 2 KV heads of 32).
    "gemma4_vl": ("Gemma4Config", "workers.models.gemma4:Gemma4ForCausalLM",
                  dict(text_config={**GEMMA4, "attention_k_eq_v": False, "num_kv_shared_layers": 0},
                       vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, head_dim=16))),
    # The 26B-A4B layout: experts beside every layer's MLP (4 experts of 32, 2 per token, a
    # per-expert scale), k_eq_v, no KV sharing, no per-layer inputs; a larger init spreads the
    # router's logits, so that no top-k choice rests on a near tie.
    "gemma4_moe": ("Gemma4TextConfig", "workers.models.gemma4:Gemma4ForCausalLM",
                   {**GEMMA4, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "enable_moe_block": True,
                    "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32, "initializer_range": 0.1}),
})
HYBRIDS = ["bamba", "nemotron_h", "nemotron_h_moe", "falcon_h1", "falcon_h1_norm", "granitemoehybrid", "granitemoehybrid_moe",
           "jamba"]
GATED_DELTANET = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_moe_vl"]


def _text_only_forward(hf) -> None:
    """transformers 5.24's Llama4ForConditionalGeneration.forward fails after its language model
    has run (it reads `image_outputs` off the language model's output); without images it is its
    language model's forward, which the references call instead."""
    lm = hf.language_model

    def forward(input_ids=None, pixel_values=None, **kwargs):
        assert pixel_values is None
        return lm(input_ids=input_ids, **kwargs)
    hf.forward = forward


def build(name: str, seed: int = 0, device: str = "cpu"):
    cls_name, ours_path, extra = CONFIGS[name]
    auto = transformers.AutoModelForCausalLM
    if "text_config" in extra:  # a multimodal wrapper: COMMON sizes its language model
        config = getattr(transformers, cls_name)(**{**extra, "text_config": {**COMMON, **extra["text_config"]}})
        auto = transformers.AutoModelForImageTextToText
    else:
        config = getattr(transformers, cls_name)(**COMMON, **extra)
    torch.manual_seed(seed)
    hf = auto.from_config(config, dtype=torch.float32).eval()
    # Random (not HF's small init) norm weights and biases, so every parameter matters.
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith(("bias", "router.scale", "per_expert_scale")):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in n else 0.0))
        for n, b in hf.named_buffers():  # (buffers: the loop above does not see them)
            if n.endswith("e_score_correction_bias"):  # DeepSeek-V3-style routers: on the scale of the scores
                b.copy_(torch.randn_like(b) * 0.2)
            elif n.endswith("layer_scalar"):  # Gemma 4's per-layer output scale, saved with the weights
                b.uniform_(0.5, 1.5)
    if type(hf).__name__ == "Llama4ForConditionalGeneration":
        _text_only_forward(hf)
    # transformers up to 5.17 fixes gpt-oss's clamp at 7 whatever the config says: the config's.
    for m in hf.modules():
        if type(m).__name__ == "GptOssExperts" and hasattr(config, "swiglu_limit"):
            m.limit = config.swiglu_limit
    # Saved with save_pretrained (several shards and an index) and read back by our loader.
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder, max_shard_size="100KB")
        assert get_model_class(hf.config.architectures).__module__ + ":" + \
            get_model_class(hf.config.architectures).__name__ == ours_path
        ours = load_model(folder, get_model_class(hf.config.architectures), TPGroup(), "float32", device)
    return hf, ours


def assert_matches_transformers(hf, ours, length: int, new_tokens: int, seed: int, device: str = "cpu") -> None:
    """A random prompt's prefill logits (within 1e-3) and greedy tokens: ours as transformers'."""
    h = Harness(ours, hf.config, device=device)
    prompt = torch.randint(0, 300, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                           attention_mask=torch.ones(1, length, dtype=torch.long))[0, length:].tolist()
    got, _ = h.prefill_logits(prompt)
    assert (got.cpu() - ref).abs().max().item() < 1e-3
    assert h.greedy(prompt, new_tokens) == want


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_logits_and_greedy_match_transformers(name):
    hf, ours = build(name, device=DEVICE)
    assert_matches_transformers(hf, ours, 40, 32, seed=1, device=DEVICE)  # longer than the windows (12)


@pytest.mark.parametrize("name", ["mistral", "qwen3", "gemma2", "gemma3", "gemma4", "gemma4_moe", "cohere2", "gpt_oss", "llama4", *HYBRIDS,
                                  *GATED_DELTANET])
def test_chunked_prefill_and_prefix_hit_equal_one_prefill(name):
    hf, ours = build(name, device=DEVICE)
    h = Harness(ours, hf.config, device=DEVICE)
    prompt = torch.randint(0, 300, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    full, _ = h.prefill_logits(prompt)
    chunked, _ = h.prefill_logits(prompt, chunk=7)
    # The delta rule's chunks (other ends, another order of fp32 sums) move the Gated DeltaNet
    # models' logits by up to ~2e-4 here, as much as their distance to a float64 forward
    # (transformers' own float32 forward is 3e-4 from it on these weights).
    tol = 5e-4 if name in GATED_DELTANET else 1e-4
    assert (chunked - full).abs().max().item() < tol
    # The first prompt's blocks are cached now: a second prefill starts after the hit.
    cached, _ = h.prefill_logits(prompt, use_cache=True)
    assert cached.shape[0] < full.shape[0]
    assert (cached - full[-cached.shape[0]:]).abs().max().item() < tol


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_checkpoint_tensor_is_expected_with_its_shape(name):
    """A tensor transformers saves but we do not list would never be loaded (and its parameter
    never written): the loader reads only expected names."""
    hf, ours = build(name)
    expected = ours.expected_checkpoint_shapes()
    tied = getattr(hf.config, "tie_word_embeddings", False)
    for key, tensor in hf.state_dict().items():
        if tied and key == "lm_head.weight" or key.startswith(ours.ignored_prefixes):  # (a vision tower)
            continue
        assert key in expected, key
        assert tuple(tensor.shape) == tuple(expected[key]), key


@pytest.mark.parametrize("name", ["nemotron_h", "nemotron_h_moe"])
def test_nemotron_h_published_names_load_the_same(tmp_path, name):
    """Published Nemotron-H checkpoints: `backbone.` weight prefixes and a config.json with
    `hybrid_override_pattern` (transformers 5 saves `model.` and `layers_block_type`); the experts
    here in transformers' stacked in-memory layout (`build` loads them one tensor each)."""
    import json

    from safetensors.torch import save_file

    from workers.models.nemotron_h import NemotronHForCausalLM
    hf, ours = build(name)
    hf.config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    pattern = hf.config.hybrid_override_pattern
    cfg.pop("layers_block_type", None)
    cfg.update(hybrid_override_pattern=pattern, num_hidden_layers=len(pattern))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    state = {("backbone." + k[len("model."):] if k.startswith("model.") else k): v.contiguous()
             for k, v in hf.state_dict().items()}
    assert any(k.startswith("backbone.layers.") for k in state)
    assert name == "nemotron_h" or any(k.endswith(".mixer.experts.up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    published = load_model(str(tmp_path), NemotronHForCausalLM, TPGroup(), "float32", "cpu")
    prompt = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    want, _ = Harness(ours, hf.config).prefill_logits(prompt)
    got, _ = Harness(published, published.config).prefill_logits(prompt)
    assert torch.equal(got, want)


def test_nemotron_h_correction_bias_moves_the_choice():
    """The router's e_score_correction_bias picks experts without weighing them: zeroing it in
    both models changes the logits (other experts chosen) and they still agree."""
    hf, ours = build("nemotron_h_moe")
    prompt = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    before, _ = Harness(ours, hf.config).prefill_logits(prompt)
    with torch.no_grad():
        for model in (hf, ours):
            for n, t in [*model.named_buffers(), *model.named_parameters()]:
                if n.endswith("e_score_correction_bias"):
                    t.zero_()
        ref = hf(torch.tensor([prompt])).logits[0]
    after, _ = Harness(ours, hf.config).prefill_logits(prompt)
    assert (after - before).abs().max().item() > 1e-2
    assert (after - ref).abs().max().item() < 1e-3


def test_nemotron_h_grouped_router_kernel_in_the_model(monkeypatch):
    """The grouped router's Triton kernel (the GPU path; here under the interpreter) in place of
    the torch ops on CPU: the model's prefill logits and greedy tokens are still transformers'."""
    import kernels.moe_routing
    import workers.layers.moe
    monkeypatch.setattr(workers.layers.moe, "topk_sigmoid_grouped_op", kernels.moe_routing.topk_sigmoid_grouped)
    hf, ours = build("nemotron_h_moe", device=DEVICE)
    assert_matches_transformers(hf, ours, 24, 8, seed=6, device=DEVICE)


def test_nemotron_h_moe_refusals():
    from workers.models.nemotron_h import NemotronHForCausalLM
    base = dict(**COMMON, hybrid_override_pattern="M*E-", mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16,
                n_groups=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    for extra, match in [(dict(moe_latent_size=16), "latent projections"), (dict(mlp_bias=True), "MLP biases"),
                         (dict(n_group=3, topk_group=1), "expert groups")]:
        with pytest.raises(ValueError, match=match):
            NemotronHForCausalLM(transformers.NemotronHConfig(**base, **extra), TPGroup(), torch.float32,
                                 torch.device("cpu"))


def test_gemma4_bidirectional_attention_is_refused_by_name():
    from workers.models.gemma4 import Gemma4ForCausalLM
    config = transformers.Gemma4TextConfig(**{**COMMON, **GEMMA4, "use_bidirectional_attention": "all"})
    with pytest.raises(ValueError, match="use_bidirectional_attention='all'"):
        Gemma4ForCausalLM(config, TPGroup(), torch.float32, torch.device("cpu"))


def test_a_layer_kind_the_family_does_not_build_is_refused():
    """The layer kinds come from the config; a family refuses one its layers are not (Granite's
    layer_types may say "hybrid", Falcon-H1's attention and Mamba side by side)."""
    from workers.models.granitemoehybrid import GraniteMoeHybridForCausalLM
    granite = transformers.GraniteMoeHybridConfig(**COMMON, num_hidden_layers=2, layer_types=["mamba", "hybrid"],
                                                  mamba_n_heads=8, mamba_d_head=16)
    with pytest.raises(ValueError, match=r"layer 1 has type 'attention\+mamba'; its layers are .*full_attention"):
        GraniteMoeHybridForCausalLM(granite, TPGroup(), torch.float32, torch.device("cpu"))


def test_granite_experts_load_under_both_spellings_and_tp_shards_them(tmp_path):
    """The published names (`input_linear`, `output_linear`, `router.layer`, what save_pretrained
    writes) and transformers 5's in-memory names load the same; a rank's experts hold its slices
    of the gate and up halves and of down's columns; a router wider than its experts is refused."""
    from safetensors.torch import save_file

    from workers.models.granitemoehybrid import GraniteMoeHybridForCausalLM
    hf, ours = build("granitemoehybrid_moe")
    hf.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.block_sparse_moe.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    v5 = load_model(str(tmp_path), GraniteMoeHybridForCausalLM, TPGroup(), "float32", "cpu")
    for (name, a), (_, b) in zip(ours.named_parameters(), v5.named_parameters()):
        assert torch.equal(a, b), name

    class Rank1:
        world_size, rank = 2, 1
    half = GraniteMoeHybridForCausalLM(hf.config, Rank1(), torch.float32, torch.device("cpu"))
    half.load_weights(state.items())
    full = state["model.layers.0.block_sparse_moe.experts.gate_up_proj"]  # [E, 2 * 128, H]
    got = half.model.layers[0].block_sparse_moe.experts
    assert full.shape[1] == 256 and got.w13.shape[1] == 128
    assert torch.equal(got.w13[:, :64], full[:, 64:128]) and torch.equal(got.w13[:, 64:], full[:, 192:])
    assert torch.equal(got.w2, state["model.layers.0.block_sparse_moe.experts.down_proj"][:, :, 64:])
    wrong = transformers.GraniteMoeHybridConfig(**{**hf.config.to_dict(), "num_experts_per_tok": 7})
    with pytest.raises(ValueError, match="experts per token must be 1 to 6"):
        GraniteMoeHybridForCausalLM(wrong, TPGroup(), torch.float32, torch.device("cpu"))


def test_qwen_shared_expert_joins_the_experts_stack(tmp_path):
    """Qwen3.5-MoE's shared expert (48 wide, routed experts 32) is kept after the routed experts
    as slots of one expert's width: at TP=2 rank 1 holds its columns 24..48, in a slot of 16 and
    one of 8 padded with zeros, not counted among the routed experts' bytes; its gate is the
    router's last row; a checkpoint without the shared gate names it."""
    from safetensors.torch import save_file

    from workers.loader import MissingWeightsError
    from workers.models.qwen3_5 import Qwen3_5MoeForCausalLM

    hf, _ = build("qwen3_5_moe")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    mlp = "model.layers.0.mlp"

    class Rank1:
        world_size, rank = 2, 1
    half = Qwen3_5MoeForCausalLM(hf.config, Rank1(), torch.float32, torch.device("cpu"))
    half.load_weights(state.items())
    experts = half.model.layers[0].mlp.experts
    assert experts.w13.shape[:2] == (4 + 2, 32) and experts.shared_slots == 2
    gate, up, down = (state[f"{mlp}.shared_expert.{p}_proj.weight"] for p in ("gate", "up", "down"))
    assert torch.equal(experts.w13[4, :16], gate[24:40]) and torch.equal(experts.w13[4, 16:], up[24:40])
    assert torch.equal(experts.w13[5, :8], gate[40:48]) and torch.equal(experts.w13[5, 16:24], up[40:48])
    assert not experts.w13[5, 8:16].any() and not experts.w13[5, 24:].any()
    assert torch.equal(experts.w2[4], down[:, 24:40]) and torch.equal(experts.w2[5, :, :8], down[:, 40:48])
    assert not experts.w2[5, :, 8:].any()
    assert experts.routed_bytes() == 4 * (experts.w13[0].numel() + experts.w2[0].numel()) * 4  # (the roofline's)
    router = half.model.layers[0].mlp.gate.weight
    assert torch.equal(router[:4], state[f"{mlp}.gate.weight"])
    assert torch.equal(router[4:5], state[f"{mlp}.shared_expert_gate.weight"])
    assert router.shape[0] == 8 and not router[5:].any()  # zero rows up to a multiple of 8

    hf.config.save_pretrained(tmp_path)
    del state[f"{mlp}.shared_expert_gate.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingWeightsError, match=r"model.layers.0.mlp.shared_expert_gate.weight"):
        load_model(str(tmp_path), Qwen3_5MoeForCausalLM, TPGroup(), "float32", "cpu")


def test_llama4_experts_layout_and_quantized_checkpoints(tmp_path):
    """The checkpoint's experts [E, H, 2I] (gate columns, then up) and [E, I, H] load as rank 1's
    halves of each expert's gate, up and down at TP=2, the shared expert in the slot after them;
    q_proj's rows of each head reordered evens first; the router whole. A quantized checkpoint is
    refused by name."""
    from workers.models.llama4 import Llama4ForCausalLM
    hf, _ = build("llama4_vl")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    ff = "language_model.model.layers.1.feed_forward"

    class Rank1:
        world_size, rank = 2, 1
    half = Llama4ForCausalLM(hf.config, Rank1(), torch.float32, torch.device("cpu"))
    loaded = half.load_weights(state.items())
    assert half.missing_weights(loaded) == []
    experts = half.model.layers[1].feed_forward.experts
    gate_up, down = state[f"{ff}.experts.gate_up_proj"], state[f"{ff}.experts.down_proj"]  # [4, 64, 256], [4, 128, 64]
    assert experts.w13.shape == (4 + 1, 128, 64) and experts.shared_slots == 1
    assert torch.equal(experts.w13[:4, :64], gate_up[:, :, 64:128].transpose(1, 2))
    assert torch.equal(experts.w13[:4, 64:], gate_up[:, :, 192:].transpose(1, 2))
    assert torch.equal(experts.w2[:4], down[:, 64:].transpose(1, 2))
    assert torch.equal(experts.w13[4, :64], state[f"{ff}.shared_expert.gate_proj.weight"][64:])
    assert torch.equal(experts.w2[4], state[f"{ff}.shared_expert.down_proj.weight"][:, 64:])
    router = half.model.layers[1].feed_forward.router  # (its rows padded to a multiple of 8)
    assert torch.equal(router.weight[:router.rows], state[f"{ff}.router.weight"])
    q = state["language_model.model.layers.1.self_attn.q_proj.weight"]  # 4 heads of 16; rank 1: heads 2, 3
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])
    assert torch.equal(half.model.layers[1].self_attn.qkv_proj.weight[:16], q[32:48][perm])
    # Meta's FP8 checkpoints (fbgemm) are refused by the quantization reader, before any model is built.
    from distengine.quantization import read_quantization_config
    with pytest.raises(ValueError, match="'fbgemm_fp8'-quantized checkpoints are not supported"):
        read_quantization_config({"text_config": {"quantization_config": {"quant_method": "fbgemm_fp8"}}})


def test_jamba_stacked_experts_and_tp_shards_of_the_mamba1_mixer(tmp_path):
    """transformers' in-memory expert layout (`experts.gate_up_proj`, `experts.down_proj`) loads
    as the published one (`build`); at TP=2 rank 1 holds the second half of the channels: in_proj's
    x and z halves each, the conv's, dt_proj's rows, A_log's rows and D, x_proj's input columns;
    a Jamba whose Mamba or MLP activation is not silu, or an int8-quantized one, is refused before
    any weight is read."""
    from safetensors.torch import save_file

    from workers.models.jamba import JambaForCausalLM
    hf, ours = build("jamba")
    hf.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.feed_forward.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    v5 = load_model(str(tmp_path), JambaForCausalLM, TPGroup(), "float32", "cpu")
    for (name, a), (_, b) in zip(ours.named_parameters(), v5.named_parameters()):
        assert torch.equal(a, b), name

    class Rank1:
        world_size, rank = 2, 1
    half = JambaForCausalLM(hf.config, Rank1(), torch.float32, torch.device("cpu"))
    half.load_weights(state.items())
    got, p = half.model.layers[0].mamba, "model.layers.0.mamba."
    i = 128  # mamba_expand * hidden_size
    assert torch.equal(got.in_proj.weight, torch.cat([state[p + "in_proj.weight"][64:128],
                                                       state[p + "in_proj.weight"][192:]]))
    assert torch.equal(got.in_proj.bias, torch.cat([state[p + "in_proj.bias"][64:128], state[p + "in_proj.bias"][192:]]))
    assert torch.equal(got.conv1d.weight, state[p + "conv1d.weight"][i // 2:])
    assert torch.equal(got.dt_proj.weight, state[p + "dt_proj.weight"][i // 2:])
    assert torch.equal(got.dt_proj.bias, state[p + "dt_proj.bias"][i // 2:])
    assert torch.equal(got.A_log, state[p + "A_log"][i // 2:]) and torch.equal(got.D, state[p + "D"][i // 2:])
    assert torch.equal(got.x_proj.weight, state[p + "x_proj.weight"][:, i // 2:])
    assert torch.equal(got.dt_layernorm.weight, state[p + "dt_layernorm.weight"])
    wrong = transformers.JambaConfig(**{**hf.config.to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="'gelu' is not supported"):
        JambaForCausalLM(wrong, TPGroup(), torch.float32, torch.device("cpu"))
    # vLLM's experts_int8 (Jamba's common quantization) is refused by the quantization reader.
    from distengine.quantization import read_quantization_config
    with pytest.raises(ValueError, match="'experts_int8'-quantized checkpoints are not supported"):
        read_quantization_config({**hf.config.to_dict(), "quantization_config": {"quant_method": "experts_int8"}})


def test_jamba_without_biases_or_experts_matches_transformers(monkeypatch):
    """The other side of Jamba's switches: no in/out_proj or conv bias, one expert (every layer a
    gated MLP, as JambaConfig's num_experts=1), attention first (attn_layer_offset 0)."""
    monkeypatch.setitem(CONFIGS, "jamba_plain", ("JambaConfig", "workers.models.jamba:JambaForCausalLM",
                                                 dict(num_hidden_layers=3, attn_layer_period=3, attn_layer_offset=0,
                                                      num_experts=1, mamba_d_state=8, mamba_dt_rank=4,
                                                      mamba_proj_bias=False, mamba_conv_bias=False,
                                                      eos_token_id=None, initializer_range=0.1)))
    hf, ours = build("jamba_plain")
    assert ours.model.layers[1].mamba.conv1d.bias is None and ours.model.layers[1].mamba.out_proj.bias is None
    assert_matches_transformers(hf, ours, 30, 16, seed=5)
