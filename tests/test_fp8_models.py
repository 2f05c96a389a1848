"""FP8 checkpoints (distengine.quantization, the FP8 linear layers) end to end: tiny random models
quantized by the test in each published layout (fp8 block-wise, fp8 per-tensor, compressed-tensors
tensor / channel / block), saved with their quantization_config, and served through `LLM` at TP=1
and TP=2. The oracle is transformers on the dequantized weights: transformers' own FP8 loading
needs accelerate (and compressed-tensors its package), so the test dequantizes with each format's
formula (W = weight * scale over its row, block or tensor) and gives transformers a float copy."""
from __future__ import annotations

import re

import pytest
import torch

from kernels.fp8 import FP8_DTYPE, quantize_fp8_ref
from tests.test_engine import _hf_greedy, _prompts

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


# The families built: Qwen3, and Gemma-3 (the benchmark's family: tied embeddings, 1 sliding : 1 full).
FAMILIES = {
    "qwen3": ("Qwen3Config", {}),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=12, sliding_window_pattern=2, query_pre_attn_scalar=24,
                                        eos_token_id=None)),
}


def _quantized_checkpoint(folder, fmt: str, seed: int = 0, family: str = "qwen3"):
    """A tiny model whose linear weights are stored as `fmt` in `folder`, and transformers' model
    holding the weights those tensors stand for."""
    quant, scale_name, layout, input_scale = FORMATS[fmt]
    torch.manual_seed(seed)
    cls_name, extra = FAMILIES[family]
    config = getattr(transformers, cls_name)(**TINY, **extra)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
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


@pytest.mark.parametrize("fmt,family", [(fmt, "qwen3") for fmt in sorted(FORMATS)] +
                         [("fp8_block", "gemma3"), ("ct_channel", "gemma3")])
def test_fp8_checkpoint_greedy_equals_transformers(tmp_path, fmt, family):
    from distengine import LLM, SamplingParams
    hf = _quantized_checkpoint(tmp_path, fmt, family=family)
    prompts = _prompts(2)
    with LLM(str(tmp_path), device="cpu", dtype="float32", block_size=4, max_model_len=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, temperature=0),
                            use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 12)


@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor"])
def test_fp8_checkpoint_tp2_on_ray_equals_transformers(tmp_path, ray_cluster, fmt):  # noqa: F811
    """Each rank's rows of the weights and their scales (blocks; rows, here each fused part's own
    per-tensor scale spread over its rows, as channel scales are placed), and row-parallel
    columns with their block columns."""
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


# ----------------------------------------------------------------------------- refusals, by name

def _ct_weights(**weights) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                     "strategy": "channel", **weights}}}}


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "gptq", "bits": 4}, "'gptq'-quantized checkpoints are not supported"),
    ({"quant_method": "awq"}, "'awq'-quantized"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'-quantized"),
    ({"quant_method": "mxfp4"}, "'mxfp4'-quantized"),  # gpt-oss's own, not a Qwen3's
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "modules_to_convert": ["embed_tokens"]},
     "modules_to_convert"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "scale_fmt 'ue8m0'"),
    ({**_ct_weights(), "format": "pack-quantized"}, "format 'pack-quantized'"),
    (_ct_weights(num_bits=4, type="int"), "4-bit 'int'"),
    (_ct_weights(strategy="group", group_size=128), "strategy 'group'"),
    (_ct_weights(symmetric=False), "asymmetric"),
])
def test_unserved_quantization_is_refused_by_name_before_any_weight_is_read(tmp_path, quant, message):
    """config.json only (no weights at all): the refusal comes first, from the engine's config
    and from the loader alike."""
    from distengine import LLM
    from workers.loader import load_model
    from workers.models.qwen3 import Qwen3ForCausalLM
    from workers.parallel import TPGroup
    config = transformers.Qwen3Config(**TINY)
    config.architectures = ["Qwen3ForCausalLM"]
    config.quantization_config = quant
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(str(tmp_path), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(tmp_path, Qwen3ForCausalLM, TPGroup(), "float32")


def test_quantization_option_and_the_checkpoint_must_agree():
    from distengine.quantization import BLOCK, resolve_quantization
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert resolve_quantization(fp8, "fp8", "auto").strategy == BLOCK
    with pytest.raises(ValueError, match="unquantized checkpoint"):
        resolve_quantization({}, "fp8", "auto")
    with pytest.raises(ValueError, match="'compressed-tensors'-quantized"):
        resolve_quantization({"quantization_config": _ct_weights()}, "fp8", "auto")
    with pytest.raises(ValueError, match="quantization must be None or 'fp8'"):
        resolve_quantization({}, "int8", "dummy")
    dummy = resolve_quantization({}, "fp8", "dummy")
    assert (dummy.block_size, dummy.scale_name) == ((128, 128), "weight_scale_inv")


class _Rank:
    def __init__(self, world_size: int, rank: int = 0) -> None:
        self.world_size, self.rank = world_size, rank


def test_a_tp_split_that_cuts_a_scale_block_is_refused_when_the_layer_is_built():
    from distengine.quantization import resolve_quantization
    from workers.layers.linear import QKVParallelLinear, RowParallelLinear, quantized_linears
    block = resolve_quantization({}, "fp8", "dummy")
    cpu = torch.device("cpu")
    with quantized_linears(block):
        QKVParallelLinear(256, 128, 4, 2, False, _Rank(2), torch.float32, cpu, "model.layers.0.self_attn.qkv_proj")
        with pytest.raises(ValueError, match=r"qkv_proj\[k\]: this rank's 64 of 128 output rows cut the checkpoint's "
                                             r"\(128, 128\) FP8 scale blocks"):
            QKVParallelLinear(256, 64, 4, 2, False, _Rank(2), torch.float32, cpu, "model.layers.0.self_attn.qkv_proj")
        with pytest.raises(ValueError, match="192 of 384 input columns cut"):
            RowParallelLinear(384, 256, False, _Rank(2, 1), torch.float32, cpu, "model.layers.0.mlp.down_proj")


def test_fused_parts_quantized_apart_and_families_fp8_does_not_serve_are_refused():
    from distengine.quantization import read_quantization_config
    from workers.layers.linear import QKVParallelLinear, quantized_linears
    from workers.models.cohere2 import Cohere2ForCausalLM
    from workers.models.jamba import JambaForCausalLM
    from workers.models.llama4 import Llama4ForCausalLM
    from workers.parallel import TPGroup
    cpu = torch.device("cpu")
    q_left_out = read_quantization_config({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["layers.0.self_attn.q_proj"]}})
    with quantized_linears(q_left_out), pytest.raises(ValueError, match="quantizes some of its parts"):
        QKVParallelLinear(256, 128, 4, 2, False, TPGroup(), torch.float32, cpu, "model.layers.0.self_attn.qkv_proj")
    config = transformers.Cohere2Config(**{**TINY, "head_dim": 64})
    with quantized_linears(q_left_out), pytest.raises(ValueError, match="Cohere2: FP8 checkpoints are not supported"):
        Cohere2ForCausalLM(config, TPGroup(), torch.float32, cpu)
    fp8 = read_quantization_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    for family, cls, config in (("Llama-4", Llama4ForCausalLM, transformers.Llama4TextConfig(**TINY)),
                                ("Jamba", JambaForCausalLM, transformers.JambaConfig(**TINY))):
        with quantized_linears(fp8), pytest.raises(ValueError, match=f"{family}: FP8 checkpoints are not supported"):
            cls(config, TPGroup(), torch.float32, cpu)


@pytest.mark.parametrize("tensor,stored,message", [
    ("model.embed_tokens.weight", FP8_DTYPE, "model.embed_tokens.weight is stored in FP8 (F8_E4M3) but is not served"),
    ("model.layers.0.self_attn.q_proj.weight", torch.float32,
     "q_proj.weight is stored as F32, but the quantization_config makes it FP8"),
])
def test_weight_dtypes_must_match_the_quantization_before_data_is_read(tmp_path, tensor, stored, message):
    from workers.loader import WeightDtypeError, load_model
    from workers.models.qwen3 import Qwen3ForCausalLM
    from workers.parallel import TPGroup
    _quantized_checkpoint(tmp_path, "fp8_block")
    state = safetensors.load_file(str(tmp_path / "model.safetensors"))
    state[tensor] = state[tensor].float().to(stored)
    safetensors.save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightDtypeError, match=re.escape(message)):
        load_model(tmp_path, Qwen3ForCausalLM, TPGroup(), "float32")


def test_dummy_fp8_weights_and_the_roofline_count_the_stored_bytes(tmp_path):
    """`--load-format dummy --quantization fp8`: linear weights FP8 in 128 x 128 blocks with
    random scales; the roofline's weight bytes are the bytes as stored, its FLOPs per element;
    `bench latency` runs on it."""
    from distengine import LLM
    from launch.bench.common import roofline_of
    from launch.cli import main
    config = transformers.Qwen3Config(**TINY)
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(tmp_path)
    rf = {}
    for quant in (None, "fp8"):
        with LLM(str(tmp_path), device="cpu", dtype="float32", load_format="dummy", quantization=quant,
                 max_model_len=64) as llm:
            rf[quant] = roofline_of(llm, bandwidth=1e12, matmul=1e12)
    h, i, q, kv = 256, 512, 512, 256
    linear = 2 * ((q + 2 * kv) * h + h * q + 2 * i * h + h * i)  # two layers
    scales = 2 * (8 * 2 + 2 * 4 + 8 * 2 + 2 * 4)
    assert rf[None].weight_bytes - rf["fp8"].weight_bytes == linear * 3 - scales * 4
    assert rf["fp8"].num_params - rf[None].num_params == scales
    assert main(["bench", "latency", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32",
                 "--load-format", "dummy", "--quantization", "fp8", "--batch-size", "1", "--input-len", "8",
                 "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0"]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8_block", "fp8_tensor", "ct_channel"])
def test_fp8_checkpoint_on_gpu_greedy_equals_transformers(tmp_path, fmt):
    """On a GPU in float32: one prompt decodes through the FP8 GEMV (in CUDA graphs), three through
    the skinny GEMM; prefills dequantize for cuBLAS."""
    from distengine import LLM, SamplingParams
    hf = _quantized_checkpoint(tmp_path, fmt)
    prompts = _prompts(3)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    with LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=128) as llm:
        one = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
        three = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert one[0].outputs[0].token_ids == _hf_greedy(hf, prompts[0], 12)
    for p, o in zip(prompts, three):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 12)


def test_fp8_experts_and_deltanet_projections_are_refused_by_name(tmp_path):
    """Qwen3-Next's FP8 checkpoints store the routed experts and the Gated DeltaNet input
    projections in FP8 too: not served, each refused naming its tensor before any data is read
    (the attention and the shared expert's linears, left unquantized here, would load)."""
    from tests.test_models import build
    from workers.loader import WeightDtypeError, load_model
    from workers.models.qwen3_next import Qwen3NextForCausalLM
    from workers.parallel import TPGroup
    hf, _ = build("qwen3_next")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    expert, in_proj = "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert expert in state and in_proj in state, sorted(state)[:40]
    for name in (expert, in_proj):
        state[name] = state[name].to(FP8_DTYPE)
    hf.config.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "modules_to_not_convert": ["lm_head", "self_attn", "linear_attn.out_proj",
                                                                "shared_expert", "mlp.gate", "layers.1.mlp"]}
    hf.config.save_pretrained(tmp_path)
    safetensors.save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightDtypeError, match=r"2 checkpoint tensors .*in_proj_qkvz.weight is stored in FP8 "
                                               r".*experts.gate_up_proj is stored in FP8"):
        load_model(tmp_path, Qwen3NextForCausalLM, TPGroup(), "float32")
