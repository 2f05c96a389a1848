"""FP8 checkpoints of the families whose q/k rows we reorder at load (Cohere2, Llama-4:
interleaved rotary pairs made neox ones, `cohere2.NeoxRows`), and Llama-4's experts as
llm-compressor writes them (one tensor per expert, each with its scales; the shared expert and
the dense MLPs FP8 too, the router left out). Every linear is quantized by the test (channel or
tensor scales), saved with its compressed-tensors config; the oracle is transformers on the
dequantized weights."""
from __future__ import annotations

import pytest
import torch

from kernels.fp8 import FP8_DTYPE, quantize_fp8_ref
from tests.test_engine import _hf_greedy, _prompts
from tests.test_fp8_models import _ct, assert_greedy_equals_transformers
from tests.test_models import COMMON, CONFIGS

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")


def _fp8_checkpoint(folder, name: str, strategy: str, seed: int = 0):
    """`tests.test_models`' tiny `name` with every nn.Linear but the head and the routers in FP8
    (`strategy` "channel" or "tensor" scales) and Llama-4's stacked experts stored one tensor per
    expert; transformers' model holding the weights those tensors stand for."""
    cls_name, _, extra = CONFIGS[name]
    config = getattr(transformers, cls_name)(**COMMON, **extra)
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in n else 0.0))
            elif p.dim() >= 2 and "embed" not in n:
                p.mul_(torch.exp(torch.randn(*p.shape[:-1], 1)))  # rows of different magnitudes

    def quantized(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, s = quantize_fp8_ref(w.contiguous(), None, per_tensor=strategy == "tensor")
        s = s.reshape(1) if strategy == "tensor" else s[:, None]
        return q, s, q.float() * s

    linears = {f"{n}.weight" for n, m in hf.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head" and not n.endswith("router")}
    state, float_state = {}, {}
    for key, t in hf.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, H, 2I] / [E, I, H], stored transposed
            base, which = key.rsplit(".", 1)
            deq = torch.empty_like(t)
            for e in range(t.shape[0]):
                w = t[e].t()
                parts = {"gate": w[: w.shape[0] // 2], "up": w[w.shape[0] // 2:]} if which == "gate_up_proj" \
                    else {"down": w}
                rows = []
                for part, pw in parts.items():
                    q, s, d = quantized(pw)
                    state[f"{base}.{e}.{part}_proj.weight"], state[f"{base}.{e}.{part}_proj.weight_scale"] = q, s
                    rows.append(d)
                deq[e] = torch.cat(rows).t()
            float_state[key] = deq
        elif key in linears:
            q, s, float_state[key] = quantized(t)
            state[key], state[f"{key[:-len('weight')]}weight_scale"] = q, s
        else:
            state[key] = float_state[key] = t.contiguous()
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    hf.load_state_dict(float_state)
    hf.config.quantization_config = _ct(strategy, ["lm_head", "re:.*router$"])
    hf.config.architectures = [type(hf).__name__]
    hf.config.save_pretrained(folder)
    safetensors.save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return hf


@pytest.mark.parametrize("name,strategy", [("llama4", "channel"), ("llama4", "tensor"), ("cohere2", "channel")])
def test_fp8_checkpoint_with_reordered_qk_rows_greedy_equals_transformers(tmp_path, name, strategy):
    """Per-channel q/k scales follow their rows to the neox order (a per-tensor one stays);
    Llama-4's experts one tensor each, the shared expert in the same stack, the score on the
    experts' input; greedy tokens with a prefix hit."""
    from distengine import LLM, SamplingParams
    hf = _fp8_checkpoint(tmp_path, name, strategy)
    greedy = SamplingParams(max_tokens=10, temperature=0)
    with LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=256, block_size=4) as llm:
        prompts = _prompts(3, shared=12)
        first = llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in rest), "the shared prefix hits"
    for p, o in zip(prompts, first + rest):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 10)


def test_llama4_fp8_layers_hold_the_stored_bytes(tmp_path):
    from workers.layers.moe_fp8 import Fp8FusedMoE
    from workers.loader import load_model
    from workers.models.llama4 import Llama4ForCausalLM
    from workers.parallel import TPGroup
    _fp8_checkpoint(tmp_path, "llama4", "channel")
    model = load_model(tmp_path, Llama4ForCausalLM, TPGroup(), "float32")
    moe, mlp = model.model.layers[1].feed_forward, model.model.layers[0].feed_forward  # experts on odd layers
    assert isinstance(moe.experts, Fp8FusedMoE) and moe.experts.w13.dtype == moe.experts.w2.dtype == FP8_DTYPE
    assert moe.experts.w13_scale.shape == (5, 256)  # 4 experts and the shared one, gate and up rows
    assert moe.router.weight.dtype == torch.float32
    assert mlp.gate_up_proj.weight.dtype == model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE


def test_llama4_fp8_tp2_on_ray_equals_transformers(tmp_path, ray_cluster):  # noqa: F811
    """Each rank's query and key heads with their reordered rows' scales, its share of every
    expert and of the shared expert."""
    hf = _fp8_checkpoint(tmp_path, "llama4", "channel", seed=1)
    assert_greedy_equals_transformers(hf, tmp_path, 10, tensor_parallel_size=2, block_size=4)


def test_block_scales_that_cut_heads_are_refused_when_the_model_is_built():
    """A q/k reordering inside heads of 128 rows moves rows across 64-row scale blocks."""
    from distengine.quantization import read_quantization_config
    from workers.layers.linear import quantized_linears
    from workers.models.cohere2 import Cohere2ForCausalLM
    from workers.parallel import TPGroup
    quant = read_quantization_config({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}})
    config = transformers.Cohere2Config(**{**COMMON, "head_dim": 128, "num_hidden_layers": 2})
    with quantized_linears(quant), pytest.raises(ValueError, match="Cohere2: FP8 q/k scale blocks of 64 rows hold "
                                                                   "parts of heads of 128"):
        Cohere2ForCausalLM(config, TPGroup(), torch.float32, torch.device("cpu"))


@pytest.mark.gpu
def test_llama4_fp8_on_gpu_greedy_equals_transformers(tmp_path):
    """On a GPU in float32: the q/k scales' rows in the FP8 GEMV and skinny GEMM, the experts'
    FP8 GEMVs and grouped GEMMs with the score on their input."""
    from tests.test_fp8_models import assert_gpu_greedy_equals_transformers
    assert_gpu_greedy_equals_transformers(_fp8_checkpoint(tmp_path, "llama4", "channel"), tmp_path, block_size=4)
