"""FP8 checkpoints (distengine.quantization, the FP8 linear layers) end to end: tiny random models
quantized by the test in each published layout (fp8 block-wise, fp8 per-tensor, compressed-tensors
tensor / channel / block), saved with their quantization_config, and served through `LLM` at TP=1
and TP=2. The oracle is transformers on the dequantized weights: transformers' own FP8 loading
needs accelerate (and compressed-tensors its package), so the test dequantizes with each format's
formula (W = weight * scale over its row, block or tensor) and gives transformers a float copy."""
from __future__ import annotations

import json
import re

import pytest
import torch

from kernels.fp8 import FP8_DTYPE, quantize_fp8_ref
from tests.test_engine import _hf_greedy, _prompts, ray_cluster  # noqa: F401 (a fixture)

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

# head_dim 128 and 2 KV heads: at TP=2 every rank's share of q, k, v, o, gate, up, down is whole 128-blocks.
TINY = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
            head_dim=128, max_position_embeddings=256, num_hidden_layers=2)
LINEAR = re.compile(r".*\.(q|k|v|o|gate|up|down)_proj\.weight$")
_CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}}


def _ct(strategy: str, ignore: list[str], static: bool = False, **weights) -> dict:
    group = {**_CT_GROUP, "weights": {**_CT_GROUP["weights"], "strategy": strategy, **weights},
             "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
                                   "strategy": "tensor" if static else "token"}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ignore}


# format -> (quantization_config, scale name, layout: "block" | "row" | "tensor", input_scale saved too)
FORMATS = {
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                   "modules_to_not_convert": ["lm_head"]}, "weight_scale_inv", "block", False),
    "fp8_tensor": ({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
                   "weight_scale", "tensor", True),
    "ct_tensor": (_ct("tensor", ["lm_head"], static=True), "weight_scale", "tensor", True),
    # layer 1's MLP left unquantized by a pattern, as llm-compressor's recipes write it
    "ct_channel": (_ct("channel", ["lm_head", "re:.*layers\\.1\\.mlp\\..*"]), "weight_scale", "row", False),
    "ct_block": (_ct("block", ["lm_head"], block_structure=[128, 128]), "weight_scale", "block", False),
}


def _quantized_checkpoint(folder, fmt: str, seed: int = 0):
    """A tiny Qwen3 whose linear weights are stored as `fmt` in `folder`, and transformers' model
    holding the weights those tensors stand for."""
    quant, scale_name, layout, input_scale = FORMATS[fmt]
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3Config(**TINY), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)
            elif LINEAR.match(n):
                p.mul_(torch.exp(torch.randn(p.shape[0], 1)))  # rows of different magnitudes
    state, float_state = {}, {}
    for name, t in hf.state_dict().items():
        t = t.contiguous()
        module = name[: -len(".weight")]
        if not LINEAR.match(name) or (fmt == "ct_channel" and ".layers.1.mlp." in name):
            state[name] = float_state[name] = t
            continue
        q, s = quantize_fp8_ref(t, (128, 128) if layout == "block" else None, per_tensor=layout == "tensor")
        if layout == "row":
            deq, s = q.float() * s[:, None], s[:, None]  # compressed-tensors' channel scales are [N, 1]
        elif layout == "tensor":
            deq = q.float() * s
            s = s.reshape(1) if quant["quant_method"] == "compressed-tensors" else s
        else:
            deq = q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)
        state[name], state[f"{module}.{scale_name}"] = q, s
        if input_scale:
            state[f"{module}.input_scale"] = torch.ones_like(s)  # static activations: not read
        float_state[name] = deq
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    hf.load_state_dict(float_state, strict=False)
    hf.config.quantization_config = quant
    hf.config.architectures = [type(hf).__name__]
    hf.config.save_pretrained(folder)
    safetensors.save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return hf


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fp8_checkpoint_greedy_equals_transformers(tmp_path, fmt):
    from distengine import LLM, SamplingParams
    hf = _quantized_checkpoint(tmp_path, fmt)
    prompts = _prompts(2)
    with LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, max_model_len=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, temperature=0),
                            use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 12)


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor", "ct_channel"])
def test_fp8_checkpoint_tp2_on_ray_equals_transformers(tmp_path, ray_cluster, fmt):  # noqa: F811
    """Each rank's rows of the weights and their scales (blocks, rows, each fused part's own
    per-tensor scale), and row-parallel columns with their block columns."""
    from distengine import LLM, SamplingParams
    hf = _quantized_checkpoint(tmp_path, fmt, seed=1)
    prompts = _prompts(2)
    with LLM(str(tmp_path), tensor_parallel_size=2, device="cpu", dtype="float32", block_size=4,
             max_model_len=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, temperature=0),
                            use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 12)


def test_fp8_layers_hold_the_stored_bytes(tmp_path):
    """Linear weights as stored (one byte an element) with fp32 scales; what the config leaves
    out (lm_head, a pattern-ignored MLP), the embedding and the norms in the model's dtype."""
    from workers.loader import load_model
    from workers.models.qwen3 import Qwen3ForCausalLM
    from workers.parallel import TPGroup
    _quantized_checkpoint(tmp_path, "ct_channel")
    model = load_model(tmp_path, Qwen3ForCausalLM, TPGroup(), "float32")
    layers = model.model.layers
    assert layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    assert layers[0].self_attn.qkv_proj.weight_scale.shape == (1024,)
    assert layers[0].mlp.gate_up_proj.weight.dtype == FP8_DTYPE and layers[1].self_attn.o_proj.weight.dtype == FP8_DTYPE
    assert layers[1].mlp.gate_up_proj.weight.dtype == torch.float32 and layers[1].mlp.gate_up_proj.fp8 is None
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
