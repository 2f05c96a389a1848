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
}


def build(name: str, seed: int = 0, device: str = "cpu"):
    cls_name, ours_path, extra = CONFIGS[name]
    config = getattr(transformers, cls_name)(**COMMON, **extra)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Random (not HF's small init) norm weights and biases, so every parameter matters.
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in n else 0.0))
    # Saved with save_pretrained (several shards and an index) and read back by our loader.
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder, max_shard_size="100KB")
        assert get_model_class(hf.config.architectures).__module__ + ":" + \
            get_model_class(hf.config.architectures).__name__ == ours_path
        ours = load_model(folder, get_model_class(hf.config.architectures), TPGroup(), "float32", device)
    return hf, ours


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_logits_and_greedy_match_transformers(name):
    hf, ours = build(name, device=DEVICE)
    h = Harness(ours, hf.config, device=DEVICE)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 300, (40,), generator=g).tolist()  # longer than the windows (12)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    got, _ = h.prefill_logits(prompt)
    assert (got.cpu() - ref).abs().max().item() < 1e-3
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                           attention_mask=torch.ones(1, 40, dtype=torch.long))[0, 40:].tolist()
    assert h.greedy(prompt, 32) == want


@pytest.mark.parametrize("name", ["mistral", "qwen3", "gemma2", "gemma3", "cohere2"])
def test_chunked_prefill_and_prefix_hit_equal_one_prefill(name):
    hf, ours = build(name, device=DEVICE)
    h = Harness(ours, hf.config, device=DEVICE)
    prompt = torch.randint(0, 300, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    full, _ = h.prefill_logits(prompt)
    chunked, _ = h.prefill_logits(prompt, chunk=7)
    assert (chunked - full).abs().max().item() < 1e-4
    # The first prompt's blocks are cached now: a second prefill starts after the hit.
    cached, _ = h.prefill_logits(prompt, use_cache=True)
    assert cached.shape[0] < full.shape[0]
    assert (cached - full[-cached.shape[0]:]).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_checkpoint_tensor_is_expected_with_its_shape(name):
    """A tensor transformers saves but we do not list would never be loaded (and its parameter
    never written): the loader reads only expected names."""
    hf, ours = build(name)
    expected = ours.expected_checkpoint_shapes()
    tied = getattr(hf.config, "tie_word_embeddings", False)
    for key, tensor in hf.state_dict().items():
        if tied and key == "lm_head.weight":
            continue
        assert key in expected, key
        assert tuple(tensor.shape) == tuple(expected[key]), key
