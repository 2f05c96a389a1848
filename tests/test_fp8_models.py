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
    hf = _quantized_checkpoint(tmp_path, fmt, seed=1)
    assert_greedy_equals_transformers(hf, tmp_path, 12, tensor_parallel_size=2, block_size=4)


def assert_greedy_equals_transformers(hf, folder, tokens: int, **options) -> None:
    """Two prompts through `LLM` on CPU in float32 (`options` added): greedy tokens as `hf`'s."""
    from distengine import LLM, SamplingParams
    prompts = _prompts(2)
    with LLM(str(folder), **{"device": "cpu", "dtype": "float32", "max_model_len": 128, **options}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=tokens, temperature=0), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, tokens)


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
    with pytest.raises(ValueError, match=r"quantization must be one of \(None, 'fp8', 'modelopt'\)"):
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
    from workers.models.jamba import JambaForCausalLM
    from workers.parallel import TPGroup
    cpu = torch.device("cpu")
    q_left_out = read_quantization_config({"quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["layers.0.self_attn.q_proj"]}})
    with quantized_linears(q_left_out), pytest.raises(ValueError, match="quantizes some of its parts"):
        QKVParallelLinear(256, 128, 4, 2, False, TPGroup(), torch.float32, cpu, "model.layers.0.self_attn.qkv_proj")
    fp8 = read_quantization_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    with quantized_linears(fp8), pytest.raises(ValueError, match="Jamba: FP8 checkpoints are not supported"):
        JambaForCausalLM(transformers.JambaConfig(**TINY), TPGroup(), torch.float32, cpu)


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
@pytest.mark.parametrize("fmt,family", [(fmt, "qwen3") for fmt in ("fp8_block", "fp8_tensor", "ct_channel")]
                         + [("fp8_block", "qwen3_5_moe"), ("fp8_block", "qwen3_next"), ("ct_channel", "qwen3_5")])
def test_fp8_checkpoint_on_gpu_greedy_equals_transformers(tmp_path, fmt, family):
    """On a GPU in float32: one prompt decodes through the FP8 GEMV (in CUDA graphs; a Gated
    DeltaNet's conv in its epilogue, the experts' GEMVs), three through the skinny GEMM (and the
    experts' GEMVs); prefills dequantize for cuBLAS (the experts' grouped GEMMs in registers)."""
    hf = _quantized_checkpoint(tmp_path, fmt) if family == "qwen3" else _deltanet_fp8_checkpoint(tmp_path, family, fmt)
    assert_gpu_greedy_equals_transformers(hf, tmp_path)


def assert_gpu_greedy_equals_transformers(hf, folder, **options) -> None:
    """The checkpoint in `folder` on a GPU in float32: one prompt alone (the GEMVs), then three
    (the skinny GEMMs), greedy tokens as `hf`'s."""
    from distengine import LLM, SamplingParams
    prompts = _prompts(3)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    with LLM(str(folder), device="cuda", dtype="float32", max_model_len=128, **options) as llm:
        one = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
        three = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert one[0].outputs[0].token_ids == _hf_greedy(hf, prompts[0], 12)
    for p, o in zip(prompts, three):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 12)


# ------------------------------------------------------------- Gated DeltaNet hybrids, as Qwen publishes them

# Whole 128-blocks at TP=1 and 2: key and value heads of 128, hidden 256, experts of 256.
DELTANET_FP8 = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=128, max_position_embeddings=512, num_hidden_layers=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4, eos_token_id=None, initializer_range=0.05)
DELTANET_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                        shared_expert_intermediate_size=256)
DELTANET_FAMILIES = {
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", DELTANET_EXPERTS),
    "qwen3_next": ("Qwen3NextConfig", dict(DELTANET_EXPERTS, mlp_only_layers=[1])),  # interleaved in_proj_qkvz / ba
    "qwen3_5": ("Qwen3_5TextConfig", {}),
}
# What Qwen's FP8 checkpoints store in FP8: the attention's, the DeltaNet's in_proj_qkv / in_proj_z /
# in_proj_qkvz and out_proj, the MLPs', the experts' and the shared expert's linears; not in_proj_b /
# in_proj_a / in_proj_ba, the routers, the shared expert's gate, the head.
DELTANET_QUANTIZED = re.compile(r".*\.(q|k|v|o|gate|up|down|in_proj_qkv|in_proj_z|in_proj_qkvz|out)_proj\.weight$|"
                                r".*\.(in_proj_qkv|in_proj_z|in_proj_qkvz)\.weight$")
DELTANET_FORMATS = {
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                   "modules_to_not_convert": ["lm_head", "embed_tokens", "linear_attn.in_proj_a", "linear_attn.in_proj_b",
                                              "linear_attn.in_proj_ba", "shared_expert_gate"]},
                  "weight_scale_inv", (128, 128)),
    "ct_channel": (_ct("channel", ["lm_head", "re:.*in_proj_(a|b|ba)$", "re:.*mlp\\.gate$",
                                   "re:.*shared_expert_gate$"]), "weight_scale", None),
}


def _deltanet_fp8_checkpoint(folder, family: str, fmt: str, seed: int = 0):
    """A tiny Gated DeltaNet hybrid saved as Qwen publishes its FP8 checkpoints (the experts one
    tensor each, with their scales), and transformers' model holding the weights they stand for."""
    quant, scale_name, block = DELTANET_FORMATS[fmt]
    cls_name, extra = DELTANET_FAMILIES[family]
    if "modules_to_not_convert" in quant:  # the routers by name, as published (matched as substrings)
        routers = [f"model.layers.{i}.mlp.gate" for i in range(4)
                   if "num_experts" in extra and i not in extra.get("mlp_only_layers", ())]
        quant = dict(quant, modules_to_not_convert=quant["modules_to_not_convert"] + routers)
    config = getattr(transformers, cls_name)(**DELTANET_FP8, **extra)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)

    def quantized(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, s = quantize_fp8_ref(t, block)
        full = s.repeat_interleave(128, 0)[:t.shape[0]].repeat_interleave(128, 1)[:, :t.shape[1]] if block \
            else s[:, None]
        return q, (s if block else s[:, None]), q.float() * full

    state, float_state = {}, {}
    for name, t in hf.state_dict().items():
        t = t.contiguous()
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stacked: one tensor an expert
            base, which = name.rsplit(".", 1)
            deq = torch.empty_like(t)
            for e in range(t.shape[0]):
                halves = {"gate": t[e, :t.shape[1] // 2], "up": t[e, t.shape[1] // 2:]} if which == "gate_up_proj" \
                    else {"down": t[e]}
                rows = []
                for part, w in halves.items():
                    q, s, d = quantized(w.contiguous())
                    state[f"{base}.{e}.{part}_proj.weight"], state[f"{base}.{e}.{part}_proj.{scale_name}"] = q, s
                    rows.append(d)
                deq[e] = torch.cat(rows)
            float_state[name] = deq
        elif DELTANET_QUANTIZED.match(name):
            q, s, d = quantized(t)
            state[name], state[f"{name[:-len('weight')]}{scale_name}"] = q, s
            float_state[name] = d
        else:
            state[name] = float_state[name] = t
    hf.load_state_dict(float_state)
    hf.config.quantization_config = quant
    hf.config.architectures = [type(hf).__name__]
    hf.config.save_pretrained(folder)
    safetensors.save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return hf


@pytest.mark.parametrize("family,fmt", [("qwen3_5_moe", "fp8_block"), ("qwen3_next", "fp8_block"),
                                        ("qwen3_5", "ct_channel")])
def test_deltanet_fp8_checkpoint_greedy_equals_transformers(tmp_path, family, fmt):
    """Qwen3.5-MoE / Qwen3.6-MoE and Qwen3-Next FP8 checkpoints as published (block scales), and
    a dense Qwen3.5 in compressed-tensors' channel scales: the experts and the DeltaNet's
    projections held in FP8; greedy tokens with prefix hits on a shared prefix."""
    from distengine import LLM, SamplingParams
    hf = _deltanet_fp8_checkpoint(tmp_path, family, fmt)
    with LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=512) as llm:
        prompts = _prompts(3, shared=5 * llm.plan.block_size // 2)  # a state kept 2 blocks in: a hit
        first = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=10, temperature=0),
                             use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]],
                            SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [2 * llm.plan.block_size] * 2, "the shared prefix hits"
    for p, o in zip(prompts, first + rest):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 10)


def test_deltanet_fp8_layers_hold_the_stored_bytes(tmp_path):
    from workers.layers.moe_fp8 import Fp8FusedMoE
    from workers.loader import load_model
    from workers.models.qwen3_5 import Qwen3_5MoeForCausalLM
    from workers.parallel import TPGroup
    _deltanet_fp8_checkpoint(tmp_path, "qwen3_5_moe", "fp8_block")
    model = load_model(tmp_path, Qwen3_5MoeForCausalLM, TPGroup(), "float32")
    gdn, moe = model.model.layers[0].linear_attn, model.model.layers[0].mlp
    assert gdn.in_proj.weight.dtype == FP8_DTYPE and gdn.in_proj.weight.shape == (1024 + 512, 256)
    assert gdn.in_proj.weight_scale_inv.shape == (12, 2) and gdn.in_proj.tail.dtype == torch.float32
    assert gdn.out_proj.weight.dtype == FP8_DTYPE
    assert isinstance(moe.experts, Fp8FusedMoE) and moe.experts.w13.dtype == moe.experts.w2.dtype == FP8_DTYPE
    assert moe.experts.w13_scale.shape == (5, 4, 2) and moe.experts.w2_scale.shape == (5, 2, 2)  # 4 experts + shared
    assert moe.gate.weight.dtype == torch.float32


def test_deltanet_fp8_checkpoint_tp2_on_ray_equals_transformers(tmp_path, ray_cluster):  # noqa: F811
    """Each rank's key and value heads of the FP8 projection with their scale blocks, its share of
    every expert and of the shared expert."""
    from distengine import LLM, SamplingParams
    hf = _deltanet_fp8_checkpoint(tmp_path, "qwen3_5_moe", "fp8_block", seed=1)
    prompts = _prompts(2)
    with LLM(str(tmp_path), tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=10, temperature=0),
                            use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 10)


def test_deltanet_fp8_refusals_name_what_is_not_served(tmp_path):
    """FP8 in_proj_b / in_proj_a (no whole scale block), FP8 experts stored stacked, and a TP share
    of the experts that cuts a scale block."""
    from workers.loader import MissingWeightsError, WeightDtypeError, load_model
    from workers.models.qwen3_5 import Qwen3_5MoeForCausalLM
    from workers.parallel import TPGroup
    _deltanet_fp8_checkpoint(tmp_path, "qwen3_5_moe", "fp8_block")
    state = safetensors.load_file(str(tmp_path / "model.safetensors"))
    good = dict(state)
    b = "model.layers.0.linear_attn.in_proj_b.weight"
    state[b] = state[b].to(FP8_DTYPE)
    safetensors.save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightDtypeError, match=re.escape(f"{b} is stored in FP8 (F8_E4M3) but is not served in FP8")):
        load_model(tmp_path, Qwen3_5MoeForCausalLM, TPGroup(), "float32")
    stacked = {k: v for k, v in good.items() if ".experts." not in k or not k.split(".experts.")[1][0].isdigit()}
    stacked["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(4, 512, 256).to(FP8_DTYPE)
    safetensors.save_file(stacked, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(MissingWeightsError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight"):
        load_model(tmp_path, Qwen3_5MoeForCausalLM, TPGroup(), "float32")
    from distengine.quantization import read_quantization_config
    from workers.layers.moe_fp8 import Fp8FusedMoE
    quant = read_quantization_config({"quantization_config": DELTANET_FORMATS["fp8_block"][0]})
    with pytest.raises(ValueError, match=r"FP8 experts in \(128, 128\) scale blocks need a share of the intermediate "
                                         r"size in whole blocks, got 64 \(tensor-parallel size 4\)"):
        Fp8FusedMoE(4, 2, 256, 256, "silu", _Rank(4, 1), torch.float32, torch.device("cpu"), "m.experts", quant=quant)


def test_deltanet_dummy_fp8_weights_are_stored_as_published(tmp_path):
    """`--load-format dummy --quantization fp8` (the benchmarks' way): the experts and the
    DeltaNet's [q | k | v | z] in FP8 with scales that keep the weights near +-1e-3, [b | a] and
    the router in the model's dtype, as Qwen's FP8 checkpoints store them."""
    from kernels.fp8 import FP8_MAX
    from workers.layers.moe_fp8 import Fp8FusedMoE
    from workers.loader import dummy_model
    from workers.models.qwen3_5 import Qwen3_5MoeForCausalLM
    from workers.parallel import TPGroup
    config = transformers.Qwen3_5MoeTextConfig(**DELTANET_FP8, **DELTANET_EXPERTS)
    config.architectures = ["Qwen3_5MoeForCausalLM"]
    config.save_pretrained(tmp_path)
    model = dummy_model(tmp_path, Qwen3_5MoeForCausalLM, TPGroup(), "float32", quantization="fp8")
    gdn, moe = model.model.layers[0].linear_attn, model.model.layers[0].mlp
    assert gdn.in_proj.weight.dtype == FP8_DTYPE and gdn.in_proj.tail.dtype == torch.float32
    assert isinstance(moe.experts, Fp8FusedMoE) and moe.gate.weight.dtype == torch.float32
    for scale in (gdn.in_proj.weight_scale_inv, moe.experts.w13_scale, moe.experts.w2_scale):
        assert 0.5e-3 / FP8_MAX <= scale.min() and scale.max() <= 1.5e-3 / FP8_MAX
