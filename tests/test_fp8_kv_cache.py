"""The fp8 KV cache end to end: the option and its refusals, the plan (attention pages at 1 byte
an element, states in the model's dtype), the checkpoint's k/v scales, `LLM` with an fp8 cache
against the same model with its float cache, and the roofline of `bench latency`.

The bound of the end-to-end checks: e4m3 keeps 3 mantissa bits, so a stored K or V element is
within 2^-4 (6.25%) of its value, and attention averages such errors over the keys; on these
weights the largest logprob difference from the float cache is 0.035 nats (Gemma-3, 257 of 278
tokens kept) and 0.038 (Bamba, 276 of 278), so the tests allow 0.1 (over 2.5x). A fault in the
fp8 path (a scale not applied, a value not converted) moves logprobs by whole nats. If no
logprob moves by more than d, the greedy token can change only where the float cache's top two
are within 2d: the tests check that, and that at least 90% of the positions keep their token
(teacher-forced: every position of the same sequences, so one changed token does not change all
that follow). At TP=2 as at TP=1; on a GPU, inside CUDA graphs (marked gpu)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from distengine import LLM, SamplingParams
from distengine.config import EngineConfig
from distengine.kv_cache.plan import make_plan
from distengine.model_config import ConfigError, load_config_dict, parse_model_config
from tests.test_models import COMMON, CONFIGS, build
from workers.loader import load_model
from workers.models import get_model_class
from workers.parallel import TPGroup

transformers = pytest.importorskip("transformers")
BOUND = 0.1  # nats; see the module's note


def test_bad_kv_cache_dtype_is_refused_before_the_model_is_read():
    for bad in ("fp8_e5m2", "bfloat16", "float8_e4m3fn", "", None):
        with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3'"):
            EngineConfig.create("/no/such/model", kv_cache_dtype=bad)
        with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
            parse_model_config(load_config_dict("llama-3-8b")[1], kv_cache_dtype=bad)
    from launch.cli import main
    with pytest.raises(SystemExit):
        main(["kv-plan", "--config", "llama-3-8b", "--kv-cache-dtype", "int8"])


@pytest.mark.parametrize("name", ["gemma-3-12b", "gemma-4-31b", "bamba-9b", "qwen3-next-80b-a3b"])
def test_fp8_plan_holds_twice_the_attention_tokens_and_keeps_state_sizes(name):
    """At the same memory an attention group's blocks hold twice the tokens: the page halves at
    the same block size (attention-only models, packed pages of different per-token sizes
    alike), or a page of the same bytes (sized by the state) holds a block twice as long
    (hybrids). A Mamba / Gated DeltaNet state keeps its bytes."""
    _, cfg = load_config_dict(name)
    auto = make_plan(parse_model_config(cfg, name), max_model_len=8192)
    fp8 = make_plan(parse_model_config(cfg, name, kv_cache_dtype="fp8"), max_model_len=8192)
    assert (auto.dtype_bytes, fp8.dtype_bytes) == (2, 1)
    attn = lambda p: [g.spec for g in p.groups if g.spec.kind != "mamba"]  # noqa: E731
    states = lambda p: {g.spec.state_bytes for g in p.groups if g.spec.kind == "mamba"}  # noqa: E731
    assert len(attn(fp8)) == len(attn(auto))
    for a, f in zip(attn(auto), attn(fp8)):
        assert f.bytes_per_token * 2 == a.bytes_per_token
    assert states(fp8) == states(auto)
    if states(auto):
        assert fp8.state_dtype_bytes == 2 and fp8.block_size >= auto.block_size
        assert fp8.page_size_bytes * fp8.state_pages <= auto.page_size_bytes * auto.state_pages
    else:
        assert fp8.block_size == auto.block_size and fp8.page_size_bytes * 2 == auto.page_size_bytes
        assert fp8.layout == auto.layout
        assert fp8.layer_slots == auto.layer_slots  # packed sub-pages in the same places
    memory = 8 << 30
    tokens = lambda p: p.to_dict(memory)["capacity_tokens_at_max_model_len"]  # noqa: E731
    assert tokens(fp8) >= (2 if not states(auto) else 1.3) * tokens(auto) * 0.99


def test_kv_plan_command_counts_one_byte_an_element(capsys):
    from launch.cli import main
    out = {}
    for dtype in ("auto", "fp8"):
        assert main(["kv-plan", "--config", "gemma-3-12b", "--max-model-len", "8192", "--kv-cache-dtype", dtype,
                     "--json"]) == 0
        out[dtype] = json.loads(capsys.readouterr().out)
    assert (out["auto"]["kv_dtype_bytes"], out["fp8"]["kv_dtype_bytes"]) == (2, 1)
    assert out["fp8"]["num_blocks"] == 2 * out["auto"]["num_blocks"]
    assert main(["kv-plan", "--config", "bamba-9b", "--kv-cache-dtype", "fp8", "--dtype", "float32"]) == 0
    text = capsys.readouterr().out
    assert "KV bytes per element 1 (fp8: e4m3 K/V; states keep the model's dtype)" in text
    assert main(["kv-plan", "--config", "bamba-9b", "--kv-cache-dtype", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["state_dtype_bytes"] == 2


def _gemma3(tmp_path, scales: dict[str, torch.Tensor] | None = None):
    """The tiny Gemma-3 (5 sliding : 1 full layers) with transformers' own initialisation, saved
    with `scales` as extra checkpoint tensors."""
    cls, _, extra = CONFIGS["gemma3"]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**COMMON, **extra),
                                                        dtype=torch.float32).eval()
    return _save(hf, tmp_path / "gemma3", scales)


def _save(hf, folder, scales=None) -> str:
    hf.save_pretrained(folder)
    if scales:
        from safetensors.torch import save_file
        save_file(scales, str(folder / "kv_scales.safetensors"))
    return str(folder)


CPU = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128)


def _teacher_forced(folder: str, kv_cache_dtype: str, prompts: list[list[int]], inspect=None, options=CPU):
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    with LLM(folder, kv_cache_dtype=kv_cache_dtype, **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        seen = llm.collective_rpc(inspect) if inspect else None
    return [pos for o in outs for pos in o.prompt_logprobs[1:]], seen


def _compare(float_cache, fp8_cache) -> None:
    same, diff = 0, 0.0
    for a, b in zip(float_cache, fp8_cache):
        top_a, top_b = max(a, key=a.get), max(b, key=b.get)
        diff = max([diff] + [abs(a[t] - b[t]) for t in a if t in b])
        same += top_a == top_b
        if top_a != top_b:
            first, second = sorted(a.values(), reverse=True)[:2]
            assert first - second < 2 * BOUND, "a token changed where the margin exceeds twice the bound"
    assert diff < BOUND, f"logprobs differ by {diff:.3f} nats"
    assert same >= 0.9 * len(float_cache), f"{same} of {len(float_cache)} positions keep their greedy token"


def _prompts(n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (60 + 7 * i,), generator=g).tolist() for i in range(n)]


def _cache_dtypes(worker):
    """(layer, what, dtype, scales) of every cache view of rank 0's model."""
    out = []
    for name, m in worker.runner.model.cache_layers().items():
        if hasattr(m, "conv_state"):
            out += [(name, "conv", m.conv_state.dtype, None), (name, "ssm", m.ssm_state.dtype, None)]
        else:
            scales = None if m.k_scale is None else (m.k_scale.item(), m.v_scale.item())
            out.append((name, "kv", m.kv_cache.dtype, scales))
    return out


def test_llm_fp8_cache_with_checkpoint_scales_matches_the_float_cache(tmp_path):
    """Gemma-3 (sliding and full layers, q/k norms): the fp8 cache with per-layer scales from the
    checkpoint, against the float32 cache on the same sequences."""
    folder = _gemma3_with_scales(tmp_path)
    prompts = _prompts()
    ref, seen = _teacher_forced(folder, "auto", prompts, _cache_dtypes)
    assert {d for *_, d, s in seen[0]} == {torch.float32} and all(s is None for *_, s in seen[0])
    got, seen = _teacher_forced(folder, "fp8", prompts, _cache_dtypes)
    assert [(d, s) for _, _, d, s in seen[0]] == [
        (torch.float8_e4m3fn, pytest.approx((0.05 + 0.01 * i, 0.02), rel=1e-6)) for i in range(6)]
    _compare(ref, got)


def test_llm_fp8_cache_on_a_mamba_hybrid_keeps_the_states_dtype(tmp_path):
    """Bamba (Mamba-2 layers and one attention layer), no scales in the checkpoint (1.0): the
    attention K/V in e4m3, the conv and SSM states in float32 as with the float cache."""
    hf, _ = build("bamba")
    folder = _save(hf, tmp_path / "bamba")
    prompts = _prompts(seed=1)
    ref, _ = _teacher_forced(folder, "auto", prompts)
    got, seen = _teacher_forced(folder, "fp8_e4m3", prompts, _cache_dtypes)
    kinds = {(what, dtype) for _, what, dtype, _ in seen[0]}
    assert kinds == {("conv", torch.float32), ("ssm", torch.float32), ("kv", torch.float8_e4m3fn)}
    assert all(s == (1.0, 1.0) for _, what, _, s in seen[0] if what == "kv")
    _compare(ref, got)


def _qwen3(tmp_path, scales):
    hf, _ = build("qwen3")  # 3 layers
    return _save(hf, tmp_path / "qwen3", scales)


def _scales_of(folder, kv_cache_dtype):
    model = load_model(folder, get_model_class(["Qwen3ForCausalLM"]), TPGroup(), "float32", "cpu",
                       kv_cache_dtype=kv_cache_dtype)
    return [layer.self_attn.attn.kv_scale_values for layer in model.model.layers]


def test_checkpoint_kv_scales_under_each_format_name(tmp_path):
    """llm-compressor's self_attn.k_scale / v_scale, compressed-tensors' k_proj.output_scale /
    v_proj.output_scale (shape [1]), the deprecated kv_scale (both); read only for an fp8 cache."""
    folder = _qwen3(tmp_path, {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_scale": torch.tensor(0.25),
        "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.125]),
        "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([2.0]),
        "model.layers.2.self_attn.kv_scale": torch.tensor(0.75)})
    assert _scales_of(folder, "fp8") == [(0.5, 0.25), (0.125, 2.0), (0.75, 0.75)]
    assert _scales_of(folder, "auto") == [(1.0, 1.0)] * 3


@pytest.mark.parametrize("scales, match", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor([0.5, 0.5])}, "only per-tensor scales"),
    ({"model.layers.7.self_attn.k_scale": torch.tensor(0.5)}, "no attention layer of Qwen3ForCausalLM takes it"),
    ({"model.layers.0.self_attn.v_scale": torch.tensor(0.0)}, "scales must be > 0"),
])
def test_bad_checkpoint_kv_scales_are_refused(tmp_path, scales, match):
    folder = _qwen3(tmp_path, scales)
    with pytest.raises(ValueError, match=match):
        _scales_of(folder, "fp8")


def test_latency_roofline_counts_the_fp8_kv_bytes(tmp_path, capsys):
    """`bench latency --kv-cache-dtype fp8`: the roofline reads the attention K/V at 1 byte an
    element, the Mamba states at the model's dtype (read and written back)."""
    from launch.bench.common import build_random_model, roofline_of
    from launch.cli import main
    folder = str(tmp_path / "tb")
    build_random_model(folder, "tiny-bamba", "cpu")
    with LLM(folder, device="cpu", max_model_len=64, kv_cache_dtype="fp8") as llm:
        rf = roofline_of(llm, bandwidth=1e12, matmul=1e12)
        plan = llm.plan
    mamba = [layer for layer in plan.layers if layer.kind == "mamba"]
    attn = [layer for layer in plan.layers if layer.kind != "mamba"]
    assert rf.kv_dtype_bytes == 1 and rf.dtype_bytes == 4  # a float32 model on CPU
    state = sum(layer.state_bytes(1, 4) for layer in mamba)
    assert rf.kv_bytes(40) == 2 * state + 40 * attn[0].bytes_per_token(1, 1)
    assert main(["bench", "latency", "--model", folder, "--device", "cpu", "--batch-size", "2", "--input-len", "8",
                 "--output-len", "4", "--num-iters", "1", "--num-iters-warmup", "0", "--kv-cache-dtype", "fp8"]) == 0
    assert "KV cache fp8 (1 B an element, as the roofline counts it)" in capsys.readouterr().out


def _gemma3_with_scales(tmp_path) -> str:
    return _gemma3(tmp_path, {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(s)
                              for i in range(6) for w, s in (("k", 0.05 + 0.01 * i), ("v", 0.02))})


@pytest.mark.gpu
def test_fp8_cache_on_gpu_with_cuda_graphs(tmp_path):
    """The Triton store and attention kernels on an fp8 cache, decode steps inside CUDA graphs:
    the tokens of the eager engine, and (teacher-forced) the float cache's within the bound."""
    folder = _gemma3_with_scales(tmp_path)
    gpu = dict(device="cuda", dtype="float32", block_size=16, max_model_len=256, max_num_seqs=8,
               gpu_memory_utilization=0.3)
    prompts = _prompts()
    _compare(_teacher_forced(folder, "auto", prompts, options=gpu)[0],
             _teacher_forced(folder, "fp8", prompts, options=gpu)[0])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    tokens = {}
    for eager in (False, True):
        with LLM(folder, kv_cache_dtype="fp8", **dict(gpu, enforce_eager=eager)) as llm:
            assert (llm.executor.worker.runner.graphs is None) == eager
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[eager] = [o.outputs[0].token_ids for o in outs]
    assert tokens[False] == tokens[True]


def test_tp2_fp8_cache_reads_the_scales_on_every_rank(tmp_path, ray_cluster):
    """At TP=2 (Ray, gloo) each rank stores its KV heads in e4m3 with the layer's scales."""
    # The workers cannot import this test module: `_cache_dtypes` travels by value.
    ray_cluster.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    folder = _gemma3_with_scales(tmp_path)
    prompts = _prompts(2)
    ref, _ = _teacher_forced(folder, "auto", prompts)
    got, seen = _teacher_forced(folder, "fp8", prompts, _cache_dtypes, dict(CPU, tensor_parallel_size=2))
    assert len(seen) == 2
    for rank in seen:
        assert [(d, s) for _, _, d, s in rank] == [
            (torch.float8_e4m3fn, pytest.approx((0.05 + 0.01 * i, 0.02), rel=1e-6)) for i in range(6)]
    _compare(ref, got)


@pytest.mark.parametrize("name", ["gemma4_packed", "bamba"])
def test_fp8_cache_equals_a_float_cache_of_the_rounded_values(tmp_path, monkeypatch, name):
    """The exact oracle, free of the model's sensitivity: the float cache storing each K and V as
    e4m3(x / scale) x scale gives the fp8 cache's logprobs, bit for bit. On Gemma-4 with full
    layers of half the sliding layers' K/V per token (packed pages: two full layers' sub-pages
    share a page) and layers reading another's K/V with its scales, and on Bamba (Mamba states
    beside the e4m3 attention), with the checkpoint's scales. (Bamba's fp8 blocks are twice as
    long, its page being sized by the state: the prefill's Mamba scan stops at other block ends,
    float32 sums in another order, so there to 1e-5.)"""
    from safetensors import safe_open

    import kernels.kv_store as kv_store
    from kernels.kv_store import FP8_DTYPE
    import workers.layers.attention as attention
    cls, path, extra = CONFIGS["gemma4"]
    monkeypatch.setitem(CONFIGS, "gemma4_packed", (cls, path, dict(
        extra, global_head_dim=16, layer_types=["sliding_attention", "full_attention", "full_attention",
                                                "sliding_attention", "sliding_attention", "full_attention"])))
    hf, _ = build(name)
    if name == "gemma4_packed":
        plan = make_plan(parse_model_config(hf.config.to_dict(), kv_cache_dtype="fp8", dtype="float32"), 1, 4, 128)
        assert plan.layout == "packed" and {p.sub_page for p in plan.layer_slots.values()} == {0, 1}
    folder = _save(hf, tmp_path / name)
    with safe_open(f"{folder}/model.safetensors", "pt") as f:
        blocks = [n[: -len(".k_proj.weight")] for n in f.keys() if n.endswith("self_attn.k_proj.weight")]
    assert blocks
    k_scale, v_scale = 0.05, 0.02
    _save(hf, tmp_path / name, {f"{b}.{w}_scale": torch.tensor(s) for b in blocks
                                for w, s in (("k", k_scale), ("v", v_scale))})
    # Both ways K and V reach the cache: the layer's own store, and the rotary launch's (`KVWrite`).
    stores = {(attention, "store_kv_op"): attention.store_kv_op, (kv_store, "store_kv_ref"): kv_store.store_kv_ref}

    def rounding(store):
        def rounded(k, v, cache, slots, *scales, **kw):
            def r(x, s):
                return ((x.float() / s).clamp(-448, 448).to(FP8_DTYPE).float() * s).to(x.dtype)
            return store(r(k, k_scale), r(v, v_scale), cache, slots, *scales, **kw)
        return rounded
    prompts = _prompts(2, seed=2)
    for (module, attr), store in stores.items():
        monkeypatch.setattr(module, attr, rounding(store))
    oracle, _ = _teacher_forced(folder, "auto", prompts)
    for (module, attr), store in stores.items():
        monkeypatch.setattr(module, attr, store)
    got, seen = _teacher_forced(folder, "fp8", prompts, _cache_dtypes)
    assert all(s == pytest.approx((k_scale, v_scale)) for _, what, _, s in seen[0] if what == "kv")
    if name == "bamba":
        assert [d.keys() for d in got] == [d.keys() for d in oracle]
        assert max(abs(a[t] - b[t]) for a, b in zip(got, oracle) for t in a) < 1e-5
    else:
        assert got == oracle
