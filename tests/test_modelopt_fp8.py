"""ModelOpt FP8 checkpoints (quant_method "modelopt", quant_algo "FP8": NVIDIA's own, such as
Nemotron-3-Nano-30B-A3B-FP8) and FP8 Mamba-2 input projections.

A tiny Nemotron-H with routed experts is saved as NVIDIA publishes the FP8 one: `backbone.`
names, a scalar `weight_scale` and `input_scale` beside every FP8 weight (the Mamba in_proj /
out_proj, the experts one tensor each, the shared expert, the MLP), the attention layer and one
Mamba layer left in the model's dtype by ModelOpt's wildcards, the router in float32, KV cache
scales beside the attention. The oracle is transformers on the dequantized weights (it has no
ModelOpt loader)."""
from __future__ import annotations

import re

import pytest
import torch

from kernels.fp8 import FP8_DTYPE, quantize_fp8_ref
from tests.test_engine import _hf_greedy, _prompts
from tests.test_fp8_models import assert_greedy_equals_transformers
from tests.test_models import COMMON, CONFIGS

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

# "ME*-EM": Mamba, MoE, attention, MLP, MoE, Mamba; the attention (2) and the last Mamba layer
# (5) left unquantized, as NVIDIA's recipe leaves the attention and the Mamba layers beside it.
IGNORE = ["lm_head", "backbone.layers.2.mixer*", "backbone.layers.5*"]
MODELOPT = {"config_groups": {"group_0": {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                                          "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                                          "targets": ["Linear"]}},
            "ignore": IGNORE, "quant_algo": "FP8", "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
            "producer": {"name": "modelopt", "version": "0.39.0"}, "quant_method": "modelopt"}
# transformers' Linear weights that a "Linear" target quantizes (the router is no Linear).
LINEAR = re.compile(r".*\.mixer\.(in_proj|out_proj|q_proj|k_proj|v_proj|o_proj|up_proj|down_proj)\.weight$|"
                    r".*\.mixer\.shared_experts\.(up|down)_proj\.weight$")


def _nemotron_modelopt_checkpoint(folder, seed: int = 0, extra: dict | None = None, quant: dict | None = None,
                                  block: tuple[int, int] | None = None):
    """The tiny Nemotron-H (`tests.test_models`' "nemotron_h_moe", or `extra`) saved as ModelOpt
    writes it (or, with `block`, `quant`'s block-wise layout), and transformers' model holding
    the weights those tensors stand for."""
    quant = quant or MODELOPT
    _, _, moe = CONFIGS["nemotron_h_moe"]
    config = transformers.NemotronHConfig(**{**COMMON, **moe, **(extra or {})})
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.copy_(torch.randn_like(p) * 0.5 + 1.0)
            elif LINEAR.match(n) or n.endswith("experts.up_proj"):
                p.mul_(torch.exp(torch.randn(*p.shape[:-1], 1)))  # rows of different magnitudes
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.2)
    scale_name = "weight_scale_inv" if block else "weight_scale"
    ignored = re.compile(r"^model\.layers\.(2|5)\.")

    def quantized(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, s = quantize_fp8_ref(t, block, per_tensor=block is None)
        full = s.repeat_interleave(block[0], 0)[:t.shape[0]].repeat_interleave(block[1], 1)[:, :t.shape[1]] \
            if block else s
        return q, s, q.float() * full

    state, float_state = {}, {}
    for name, t in hf.state_dict().items():
        t = t.contiguous()
        published = "backbone." + name[len("model."):] if name.startswith("model.") else name
        if ignored.match(name) and not block:
            state[published] = float_state[name] = t
        elif name.endswith(("experts.up_proj", "experts.down_proj")):  # stacked in memory: one tensor an expert
            base, which = published.rsplit(".", 1)
            deq = torch.empty_like(t)
            for e in range(t.shape[0]):
                q, s, deq[e] = quantized(t[e].contiguous())
                state[f"{base}.{e}.{which}.weight"], state[f"{base}.{e}.{which}.{scale_name}"] = q, s
                if not block:
                    state[f"{base}.{e}.{which}.input_scale"] = torch.tensor(0.02)  # static activations: not read
            float_state[name] = deq
        elif LINEAR.match(name):
            q, s, float_state[name] = quantized(t)
            state[published], state[f"{published[:-len('weight')]}{scale_name}"] = q, s
            if not block:
                state[f"{published[:-len('weight')]}input_scale"] = torch.tensor(0.02)
        else:
            state[published] = float_state[name] = t
    if not block:  # ModelOpt's KV cache scales beside the attention: read only for an fp8 cache
        for part in ("k", "v"):
            state[f"backbone.layers.2.mixer.{part}_proj.{part}_scale"] = torch.tensor(1.0)
    hf.load_state_dict(float_state)
    hf.config.quantization_config = quant
    hf.config.architectures = [type(hf).__name__]
    hf.config.save_pretrained(folder)
    safetensors.save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return hf


def test_modelopt_configs_are_read_and_what_is_not_served_is_refused():
    from distengine.quantization import MODELOPT as METHOD
    from distengine.quantization import TENSOR, read_quantization_config, resolve_quantization
    q = read_quantization_config({"quantization_config": MODELOPT})
    assert (q.method, q.strategy, q.block_size, q.scale_name) == (METHOD, TENSOR, None, "weight_scale")
    # The older nested form (hf_quant_config.json's, in config.json): exclude_modules.
    nested = read_quantization_config({"quantization_config": {
        "quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "exclude_modules": ["lm_head"]}}})
    assert nested.ignore == ("lm_head",)
    # ModelOpt's wildcards: "x*" is the module x and those under it, not its namesakes x0..x9.
    assert not q.quantizes("model.layers.5.mixer.in_proj") and not q.quantizes("model.layers.2.mixer.q_proj")
    assert q.quantizes("model.layers.1.mixer.experts.0.up_proj") and not q.quantizes("lm_head")
    wide = read_quantization_config({"quantization_config": {**MODELOPT, "ignore": ["model.layers.4*", "*.q_proj"]}})
    assert not wide.quantizes("model.layers.4.mixer.in_proj") and wide.quantizes("model.layers.40.mixer.in_proj")
    assert not wide.quantizes("model.layers.7.self_attn.q_proj") and wide.quantizes("model.layers.7.self_attn.k_proj")
    assert read_quantization_config({"quantization_config": {"quant_method": "modelopt", "kv_cache_scheme": {
        "dynamic": False, "num_bits": 8, "type": "float"}}}) is None  # KV cache scales alone
    with pytest.raises(ValueError, match="modelopt checkpoint with quant_algo 'NVFP4': not supported"):
        read_quantization_config({"quantization_config": {**MODELOPT, "quant_algo": "NVFP4"}})
    with pytest.raises(ValueError, match="ignore / exclude_modules must be a list"):
        read_quantization_config({"quantization_config": {**MODELOPT, "ignore": "lm_head"}})
    hf = {"quantization_config": MODELOPT}
    assert resolve_quantization(hf, "modelopt", "auto") == q
    with pytest.raises(ValueError, match="quantization='fp8' but the checkpoint is 'modelopt'-quantized"):
        resolve_quantization(hf, "fp8", "auto")
    with pytest.raises(ValueError, match="quantization must be one of"):
        resolve_quantization({}, "nvfp4", "auto")
    dummy = resolve_quantization({}, "modelopt", "dummy")  # NVIDIA's layout: per-tensor scales
    assert (dummy.method, dummy.strategy, dummy.scale_name) == (METHOD, TENSOR, "weight_scale")


def test_nemotron_modelopt_checkpoint_greedy_equals_transformers(tmp_path):
    """Nemotron-3-Nano's FP8 layout through `LLM`: greedy tokens as transformers' on the
    dequantized weights, with prefix hits on a shared prefix (the Mamba states kept)."""
    from distengine import LLM, SamplingParams
    hf = _nemotron_modelopt_checkpoint(tmp_path)
    greedy = SamplingParams(max_tokens=10, temperature=0)
    with LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=512) as llm:
        prompts = _prompts(3, shared=5 * llm.plan.block_size // 2)  # a state kept 2 blocks in: a hit
        first = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy, use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [2 * llm.plan.block_size] * 2, "the shared prefix hits"
    for p, o in zip(prompts, first + rest):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 10)


def test_nemotron_modelopt_layers_hold_the_stored_bytes(tmp_path):
    from workers.layers.moe_fp8 import Fp8FusedMoE
    from workers.loader import load_model
    from workers.models.nemotron_h import NemotronHForCausalLM
    from workers.parallel import TPGroup
    _nemotron_modelopt_checkpoint(tmp_path)
    model = load_model(tmp_path, NemotronHForCausalLM, TPGroup(), "float32")
    layers = model.model.layers
    mamba, moe, attention, mlp, last = (layers[i].mixer for i in (0, 1, 2, 3, 5))
    assert mamba.in_proj.weight.dtype == mamba.out_proj.weight.dtype == FP8_DTYPE
    assert mamba.in_proj.weight_scale.shape == (mamba.in_proj.weight.shape[0],)  # per tensor, spread per row
    assert isinstance(moe.experts, Fp8FusedMoE) and moe.experts.w13.dtype == moe.experts.w2.dtype == FP8_DTYPE
    # 8 experts and the shared one of 48 columns in two slots of 32
    assert moe.experts.w13.shape == (10, 32, 64) and moe.experts.w13_scale.shape == (10, 32)
    assert moe.gate.weight.dtype == torch.float32
    assert mlp.up_proj.weight.dtype == FP8_DTYPE
    assert attention.qkv_proj.weight.dtype == last.in_proj.weight.dtype == torch.float32  # left out by wildcards
    assert last.out_proj.weight.dtype == torch.float32


def test_nemotron_modelopt_checkpoint_tp2_on_ray_equals_transformers(tmp_path, ray_cluster):  # noqa: F811
    """Each rank's segments of the FP8 in_proj with their rows' scales, its out_proj columns, its
    share of every expert and of the shared expert."""
    hf = _nemotron_modelopt_checkpoint(tmp_path, seed=1)
    assert_greedy_equals_transformers(hf, tmp_path, 10, tensor_parallel_size=2)


# A Nemotron-H whose Mamba in_proj segments are whole 128-row blocks (z, x, B, C of 128; dt's 8
# rows end the matrix), with experts of 128: FP8 in 128 x 128 blocks everywhere.
BLOCKED = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64, mamba_num_heads=8,
               mamba_head_dim=16, n_groups=1, ssm_state_size=128, moe_intermediate_size=128,
               moe_shared_expert_intermediate_size=128, intermediate_size=256)
FP8_BLOCK = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["lm_head", "mixer.gate"]}


def test_mamba_in_proj_in_scale_blocks_and_a_split_that_cuts_them(tmp_path):
    """Block scales follow each segment's rows (the last, partial block with dt); a TP share of a
    segment that cuts a block is refused when the layer is built."""
    from distengine.quantization import read_quantization_config
    from workers.layers.linear import quantized_linears
    from workers.layers.mamba import Segmented
    from workers.loader import load_model
    from workers.models.nemotron_h import NemotronHForCausalLM
    from workers.parallel import TPGroup
    hf = _nemotron_modelopt_checkpoint(tmp_path, extra=BLOCKED, quant=FP8_BLOCK, block=(128, 128))
    in_proj = load_model(tmp_path, NemotronHForCausalLM, TPGroup(), "float32").model.layers[0].mixer.in_proj
    assert in_proj.weight.dtype == FP8_DTYPE and in_proj.weight_scale_inv.shape == (5, 1)
    assert_greedy_equals_transformers(hf, tmp_path, 8)
    quant = read_quantization_config({"quantization_config": FP8_BLOCK})
    with quantized_linears(quant), pytest.raises(ValueError, match=r"m\.in_proj: this rank's 64 of 520 output rows "
                                                                    r"cut the checkpoint's \(128, 128\) FP8 scale"):
        Segmented([(128, 64, 64), (128, 64, 64), (128, 0, 128), (128, 0, 128), (8, 4, 4)], (128,), False,
                  torch.float32, "cpu", "m.in_proj", linear=True, tp_size=2)


def test_dummy_modelopt_weights_and_the_benchmark(tmp_path):
    """`--load-format dummy --quantization modelopt` (the benchmarks' way for NVIDIA's layout):
    every linear, the Mamba in_proj and the experts in FP8 with per-row scales near +-1e-3 (no
    block constraint on Nemotron-3-Nano's 1,856-wide experts); `bench latency` runs on it."""
    from kernels.fp8 import FP8_MAX
    from launch.cli import main
    from workers.layers.moe_fp8 import Fp8FusedMoE
    from workers.loader import dummy_model
    from workers.models.nemotron_h import NemotronHForCausalLM
    from workers.parallel import TPGroup
    _, _, moe = CONFIGS["nemotron_h_moe"]
    config = transformers.NemotronHConfig(**COMMON, **moe)
    config.architectures = ["NemotronHForCausalLM"]
    config.save_pretrained(tmp_path)
    model = dummy_model(tmp_path, NemotronHForCausalLM, TPGroup(), "float32", quantization="modelopt")
    mamba, experts = model.model.layers[0].mixer, model.model.layers[1].mixer.experts
    assert mamba.in_proj.weight.dtype == FP8_DTYPE and isinstance(experts, Fp8FusedMoE)
    for scale in (mamba.in_proj.weight_scale, experts.w13_scale, experts.w2_scale):
        assert scale.dim() == 1 + (scale is not mamba.in_proj.weight_scale)  # one per row
        assert 0.5e-3 / FP8_MAX <= scale.min() and scale.max() <= 1.5e-3 / FP8_MAX
    assert main(["bench", "latency", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32",
                 "--load-format", "dummy", "--quantization", "modelopt", "--batch-size", "1", "--input-len", "8",
                 "--output-len", "3", "--num-iters", "1", "--num-iters-warmup", "0"]) == 0


@pytest.mark.gpu
def test_nemotron_modelopt_on_gpu_greedy_equals_transformers(tmp_path):
    """On a GPU in float32: one prompt decodes through the FP8 GEMVs in CUDA graphs (the Mamba
    conv in in_proj's epilogue, the ungated experts' GEMVs), three through the skinny GEMMs;
    prefills dequantize for cuBLAS and run the experts' FP8 grouped GEMMs."""
    from tests.test_fp8_models import assert_gpu_greedy_equals_transformers
    assert_gpu_greedy_equals_transformers(_nemotron_modelopt_checkpoint(tmp_path), tmp_path)


@pytest.mark.parametrize("name", ["bamba", "falcon_h1", "granitemoehybrid"])
def test_other_mamba2_hybrids_in_modelopt_fp8_greedy_equals_transformers(tmp_path, name):
    """Every nn.Linear of the other Mamba-2 hybrids in FP8 with per-tensor scales (their Mamba
    in_proj too; Falcon-H1 scales the projection's segments after it, Granite's shared MLP holds
    its gate and up in one `input_linear`), as ModelOpt would write them."""
    cls_name, _, extra = CONFIGS[name]
    config = getattr(transformers, cls_name)(**COMMON, **extra)
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in n else 0.0))
    linears = {f"{n}.weight" for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    state, float_state = {}, {}
    for key, t in hf.state_dict().items():
        t = t.contiguous()
        if key in linears:
            q, s = quantize_fp8_ref(t, None, per_tensor=True)
            state[key], state[f"{key[:-len('weight')]}weight_scale"] = q, s
            float_state[key] = q.float() * s
        else:
            state[key] = float_state[key] = t
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    hf.load_state_dict(float_state)
    hf.config.quantization_config = {**MODELOPT, "ignore": ["lm_head"]}
    hf.config.architectures = [type(hf).__name__]
    hf.config.save_pretrained(tmp_path)
    safetensors.save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert_greedy_equals_transformers(hf, tmp_path, 10, max_model_len=256)
