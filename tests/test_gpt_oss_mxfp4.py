"""gpt-oss as published: MXFP4 experts (`*_blocks` / `*_scales`, quantization_config "mxfp4"),
kept 4-bit by our loader, against transformers loading the same folder with
Mxfp4Config(dequantize=True) (which runs on CPU); bad layouts refused."""
from __future__ import annotations

import json

import pytest
import torch

from distengine import LLM, SamplingParams
from tests.model_harness import Harness
from tests.test_models import COMMON, CONFIGS
from workers.loader import MissingWeightsError, WeightShapeError, load_model
from workers.models.gpt_oss import GptOssForCausalLM
from workers.parallel import TPGroup

transformers = pytest.importorskip("transformers")

PUBLISHED_QUANT = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def write_mxfp4_gpt_oss(folder, seed: int = 0, quant: dict = PUBLISHED_QUANT, layers: int = 2) -> None:
    """A tiny gpt-oss in the published layout: transformers' random model saved, its experts'
    bf16 tensors replaced by random MXFP4 blocks (any byte: every e2m1 value) and scales of
    2^-6 .. 2^-4 (weights on the scale of the other layers'), the config given `quant`."""
    from safetensors.torch import load_file, save_file
    _, _, extra = CONFIGS["gpt_oss"]
    config = transformers.GptOssConfig(**COMMON, **{**extra, "num_hidden_layers": layers})
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms and biases, as tests/test_models.py's `build`
        for n, p in hf.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in n else 0.0))
    hf.save_pretrained(folder)
    state = load_file(str(folder / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in state if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        e, k, rows = state.pop(name).shape  # transformers' [E, K, N]
        state[name + "_blocks"] = torch.randint(0, 256, (e, rows, k // 32, 16), dtype=torch.uint8, generator=g)
        state[name + "_scales"] = torch.randint(121, 124, (e, rows, k // 32), dtype=torch.uint8, generator=g)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = quant
    (folder / "config.json").write_text(json.dumps(cfg))


def transformers_dequantized(folder):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    # Up to 5.17 the dequantized experts stay bf16 whatever `dtype` asks (then they compute in
    # bf16); every MXFP4 value is exact in bf16, so float32 copies are the same weights.
    hf.float()
    for m in hf.modules():  # transformers up to 5.17 fixes the clamp at 7: the config's
        if type(m).__name__ == "GptOssExperts":
            m.limit = hf.config.swiglu_limit
    return hf


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write_mxfp4_gpt_oss(folder)
    return folder, transformers_dequantized(folder)


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()


def _prompts(n: int):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 300, (20 + 3 * i,), generator=g).tolist() for i in range(n)]


def test_experts_stay_4_bit_and_logits_match_transformers(mxfp4_folder):
    folder, hf = mxfp4_folder
    ours = load_model(str(folder), GptOssForCausalLM, TPGroup(), "float32", "cpu")
    experts = ours.model.layers[0].mlp.experts
    assert experts.w13_blocks.dtype == torch.uint8 and tuple(experts.w13_blocks.shape) == (4, 256, 32)
    assert not any(p.dtype == torch.float32 and p.dim() == 3 for p in ours.parameters())  # no bf16 copy
    assert ours.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    prompt = _prompts(1)[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    got, _ = Harness(ours, hf.config).prefill_logits(prompt)
    assert (got - want).abs().max().item() < 1e-3


def test_a_rank_holds_its_share_of_the_4_bit_experts(mxfp4_folder):
    """At TP=2 rank 1 holds the (gate, up) row pairs of columns 64..127 (rows 128..255, still
    interleaved) with their bias, and the down weights' second half of K, scales with them."""
    from safetensors.torch import load_file
    folder, _ = mxfp4_folder
    state = load_file(str(folder / "model.safetensors"))
    ours = load_model(str(folder), GptOssForCausalLM, TPGroup(rank=1, world_size=2), "float32", "cpu")
    ex = ours.model.layers[1].mlp.experts
    blocks = state["model.layers.1.mlp.experts.gate_up_proj_blocks"]
    assert torch.equal(ex.w13_blocks, blocks[:, 128:].flatten(2))
    assert torch.equal(ex.b13, state["model.layers.1.mlp.experts.gate_up_proj_bias"][:, 128:])
    scales = state["model.layers.1.mlp.experts.down_proj_scales"]
    assert torch.equal(ex.w2_scales, scales[:, :, 2:])
    assert torch.equal(ex.w2_blocks, state["model.layers.1.mlp.experts.down_proj_blocks"][:, :, 2:].flatten(2))


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_equals_transformers_through_llm(mxfp4_folder, tp, request):
    if tp == 2:
        request.getfixturevalue("ray_cluster")
    folder, hf = mxfp4_folder
    prompts = _prompts(3)
    with LLM(str(folder), tensor_parallel_size=tp, device="cpu", dtype="float32", block_size=4,
             max_model_len=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 12)


def test_experts_named_in_modules_to_not_convert_load_in_bf16(tmp_path):
    """A layer whose experts the config keeps unconverted reads them as bf16 tensors."""
    quant = {**PUBLISHED_QUANT, "modules_to_not_convert": [*PUBLISHED_QUANT["modules_to_not_convert"],
                                                           "model.layers.1.mlp.experts"]}
    config = transformers.GptOssConfig(**COMMON, **{**CONFIGS["gpt_oss"][2], "num_hidden_layers": 2},
                                       quantization_config=quant)
    ours = GptOssForCausalLM(config, TPGroup(), torch.float32, torch.device("cpu"))
    shapes = ours.expected_checkpoint_shapes()
    assert shapes["model.layers.0.mlp.experts.gate_up_proj_blocks"] == (4, 256, 2, 16)
    assert shapes["model.layers.1.mlp.experts.gate_up_proj"] == (4, 64, 256)
    assert "model.layers.1.mlp.experts.gate_up_proj_blocks" not in shapes


def test_bad_layouts_and_splits_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    write_mxfp4_gpt_oss(tmp_path, layers=1)
    state = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj_scales"
    save_file({k: v for k, v in state.items() if k != name}, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingWeightsError, match=name):
        load_model(str(tmp_path), GptOssForCausalLM, TPGroup(), "float32", "cpu")
    blocks = "model.layers.0.mlp.experts.gate_up_proj_blocks"
    save_file({**state, blocks: state[blocks].flatten(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightShapeError, match=rf"{blocks}: expected \(4, 256, 2, 16\), found \(4, 256, 32\)"):
        load_model(str(tmp_path), GptOssForCausalLM, TPGroup(), "float32", "cpu")
    config = transformers.GptOssConfig(**{**COMMON, "intermediate_size": 160},
                                       **{**CONFIGS["gpt_oss"][2], "num_hidden_layers": 1},
                                       quantization_config=PUBLISHED_QUANT)
    with pytest.raises(ValueError, match="tensor-parallel size 2 would give each rank 80 .* whole 32-element"):
        GptOssForCausalLM(config, TPGroup(rank=0, world_size=2), torch.float32, torch.device("cpu"))
    config.quantization_config = {"quant_method": "fp8"}
    with pytest.raises(ValueError, match="'fp8'-quantized checkpoints are not supported"):
        GptOssForCausalLM(config, TPGroup(), torch.float32, torch.device("cpu"))


def test_dummy_weights_in_the_stored_format_and_the_roofline_counts_their_bytes(tmp_path, capsys):
    """`bench latency --load-format dummy` on a gpt-oss shape whose config says mxfp4: the experts
    are random bytes and scales (finite outputs), and the roofline counts them as stored, 4.25
    bits a weight; the shape refuses a bf16 build."""
    from launch.bench.common import build_random_model, roofline_of
    from launch.cli import main
    folder, out = tmp_path / "tg", tmp_path / "lat.json"
    assert main(["bench", "latency", "--shape", "tiny-gpt-oss-mxfp4", "--load-format", "dummy", "--model-dir",
                 str(folder), "--device", "cpu", "--batch-size", "2", "--input-len", "20", "--output-len", "4",
                 "--num-iters", "1", "--num-iters-warmup", "0", "--output-json", str(out)]) == 0
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    assert "B=2 decode step (ms)" in capsys.readouterr().out
    with LLM(str(folder), device="cpu", load_format="dummy", max_model_len=64) as llm:
        rf = roofline_of(llm, bandwidth=1e12, matmul=1e12)
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 12
    weights = 8 * 3 * 64 * 64  # E x (gate, up, down) x I x H
    biases = 8 * (2 * 64 + 64) * rf.dtype_bytes
    assert rf.experts == ((8, 2, weights * 17 // 32 + biases),) * 2  # 4 bits and one byte a 32
    assert rf.num_params == rf.weight_bytes // rf.dtype_bytes + 2 * (weights + biases // rf.dtype_bytes) * 2 // 8
    with pytest.raises(ValueError, match="run it with --load-format dummy"):
        build_random_model(str(tmp_path / "w"), "tiny-gpt-oss-mxfp4", "cpu")
    # The dummy router spreads the choice: 16 tokens' hidden states (normed by dummy weights) pick
    # most of the 8 experts (the router's bias alone would give every token the same 2).
    from workers.loader import dummy_model
    model = dummy_model(str(folder), GptOssForCausalLM, TPGroup(), "float32", "cpu")
    layer = model.model.layers[0]
    hidden = layer.post_attention_layernorm(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)))
    assert layer.mlp.router(hidden).topk(2, dim=-1).indices.unique().numel() >= 6


@pytest.mark.gpu
def test_on_a_gpu_fp32_tokens_are_transformers_and_bf16_graphs_equal_eager(mxfp4_folder):
    """The Triton path: fp32 (the kernel's own decode) gives transformers' greedy tokens; bf16
    (`tl.dot_scaled`) in CUDA graphs gives the eager tokens."""
    folder, hf = mxfp4_folder
    prompts = _prompts(3)
    kw = dict(device="cuda", block_size=16, max_model_len=128, gpu_memory_utilization=0.3)
    with LLM(str(folder), dtype="float32", **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 12)
    tokens = {}
    for eager in (False, True):
        with LLM(str(folder), dtype="bfloat16", enforce_eager=eager, **kw) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        tokens[eager] = [o.outputs[0].token_ids for o in outs]
    assert tokens[False] == tokens[True]
