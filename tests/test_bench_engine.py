"""`distengine bench latency` and `bench throughput` on CPU with a tiny random Gemma-3-shaped
model (the same code as on GPUs): vLLM's flags, our figure beside the roofline and transformers'
generate(), JSON output; a dataset file; bad arguments refused. And the host-time benchmark, and
`profile_decode`'s timed rounds against the roofline."""
from __future__ import annotations

import json
import math
import re

import pytest

from launch.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from launch.bench.common import build_random_model
    folder = str(tmp_path_factory.mktemp("tiny"))
    build_random_model(folder, "tiny", "cpu")
    return folder


def test_bench_latency(tiny, tmp_path, capsys):
    out = tmp_path / "lat.json"
    assert main(["bench", "latency", "--model", tiny, "--device", "cpu", "--batch-size", "1", "3", "--input-len", "8",
                 "--output-len", "5", "--num-iters", "2", "--num-iters-warmup", "1", "--hf",
                 "--output-json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "B=3 decode step (ms)" in text and "HF generate" in text and "roofline" in text
    res = json.loads(out.read_text())
    assert res["kind"] == "latency" and res["engine"]["weight_bytes"] > 0 and res["copy_bandwidth"] > 0
    for r, b in zip(res["results"], (1, 3)):
        assert r["batch_size"] == b and len(r["latencies"]) == 2 and r["hf_output_tok_s"] > 0
        assert math.isfinite(r["decode_step_s"]) and 0 < r["roofline_decode_step_s"] < r["decode_step_s"]
        assert r["output_tok_s"] == pytest.approx(b * 5 / r["avg_latency"])
    # n completions a prompt: b x n sequences decode.
    assert main(["bench", "latency", "--model", tiny, "--device", "cpu", "--batch-size", "2", "--input-len", "8",
                 "--output-len", "4", "--n", "3", "--num-iters", "1", "--num-iters-warmup", "0",
                 "--output-json", str(out)]) == 0
    r = json.loads(out.read_text())["results"][0]
    assert r["n"] == 3 and math.isfinite(r["decode_step_s"]) and r["output_tok_s"] == pytest.approx(24 / r["avg_latency"])
    # The KV blocks held at the peak: a prompt of several blocks is held once for its n completions.
    peak = {}
    for n in (1, 3):
        assert main(["bench", "latency", "--model", tiny, "--device", "cpu", "--batch-size", "1", "--input-len", "96",
                     "--output-len", "2", "--n", str(n), "--num-iters", "1", "--num-iters-warmup", "0",
                     "--output-json", str(out)]) == 0
        peak[n] = json.loads(out.read_text())["results"][0]["peak_kv_blocks"]
    assert "B=1 peak KV blocks held" in capsys.readouterr().out
    assert 0 < peak[1] < peak[3] < 2 * peak[1]


def test_bench_throughput_random_and_dataset(tiny, tmp_path, capsys):
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", tiny, "--device", "cpu", "--num-prompts", "5", "--input-len", "6",
                 "--output-len", "4", "--output-json", str(out)]) == 0
    assert "Throughput:" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["num_requests"] == 5 and res["output_tokens"] == 20 and res["prompt_tokens"] == 30
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt_token_ids": [3, 4, 5][:n], "output_len": n}) for n in (1, 2, 3)))
    assert main(["bench", "throughput", "--model", tiny, "--device", "cpu", "--dataset-path", str(data),
                 "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["num_requests"] == 3 and res["output_tokens"] == 6 and res["prompt_tokens"] == 6


def test_bench_throughput_async_engine(tiny, tmp_path, capsys):
    """`--async-engine`: the same requests through AsyncLLM, every request's deltas counted."""
    out = tmp_path / "tp.json"
    assert main(["bench", "throughput", "--model", tiny, "--device", "cpu", "--num-prompts", "6", "--input-len", "5",
                 "--output-len", "7", "--async-engine", "--output-json", str(out)]) == 0
    assert "AsyncLLM" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["async_engine"] and res["num_requests"] == 6 and res["output_tokens"] == 42
    assert res["prompt_tokens"] == 30 and res["output_tok_s"] > 0


def test_bad_bench_arguments(tiny, tmp_path, capsys):
    assert main(["bench", "latency", "--model", tiny, "--device", "cpu", "--input-len", "0"]) == 2
    assert "--input-len must be >= 1" in capsys.readouterr().err
    assert main(["bench", "latency", "--model", tiny, "--device", "cpu", "--load-format", "dummy", "--hf"]) == 2
    assert "--hf needs the checkpoint's weights" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"text": "no prompt"}]))
    assert main(["bench", "throughput", "--model", tiny, "--device", "cpu", "--dataset-path", str(bad)]) == 2
    assert "request 0 needs 'prompt' or 'prompt_token_ids'" in capsys.readouterr().err


def test_host_time_per_decode_step_runs():
    from launch.bench.host import measure
    parts = measure("llama-3-8b", batch=4, context=40, steps=3, max_model_len=64)
    assert set(parts) == {"schedule", "msgpack", "prepare", "update"} and all(v > 0 for v in parts.values())


def test_mamba_hybrid_roofline_moves_each_state_twice(tmp_path):
    """A Mamba hybrid's decode step moves the weights, the attention K/V it reads, and every Mamba
    layer's state read and written back; `bench latency` runs on it (the `tiny-bamba` shape)."""
    from distengine import LLM
    from launch.bench.common import build_random_model, roofline_of
    folder = str(tmp_path / "tb")
    build_random_model(folder, "tiny-bamba", "cpu")
    with LLM(folder, device="cpu", max_model_len=64) as llm:
        rf = roofline_of(llm, bandwidth=1e12, matmul=1e12)
        plan = llm.plan
    mamba = [layer for layer in plan.layers if layer.kind == "mamba"]
    attn = [layer for layer in plan.layers if layer.kind != "mamba"]
    assert len(mamba) == 3 and len(attn) == 1
    state = sum(layer.state_bytes(1, rf.dtype_bytes) for layer in mamba)
    assert state > 0
    assert rf.kv_bytes(40) == 2 * state + 40 * attn[0].bytes_per_token(1, rf.dtype_bytes)
    assert rf.decode_step_s([40, 40]) == pytest.approx((rf.weight_bytes + 2 * rf.kv_bytes(40)) / 1e12)
    assert main(["bench", "latency", "--model", folder, "--device", "cpu", "--batch-size", "2", "--input-len", "8",
                 "--output-len", "4", "--num-iters", "1", "--num-iters-warmup", "0",
                 "--output-json", str(tmp_path / "lat.json")]) == 0


def test_moe_roofline_reads_only_the_chosen_experts(tmp_path, capsys):
    """Routed experts count in a decode step's bytes only as far as its tokens choose them: a
    batch of B tokens reads E * (1 - (1 - k/E)^B) of a layer's E experts (uniform routing), so one
    token reads k and a large batch nearly all; the prefill's FLOPs count k experts per token.
    `bench latency` runs on such a model (the `tiny-granite-moe` shape)."""
    from distengine import LLM
    from launch.bench.common import build_random_model, roofline_of
    folder = str(tmp_path / "tg")
    build_random_model(folder, "tiny-granite-moe", "cpu")
    with LLM(folder, device="cpu", max_model_len=64) as llm:
        rf = roofline_of(llm, bandwidth=1e12, matmul=1e12)
        total = llm.info.memory[0].weight_bytes
    per_layer = 8 * 3 * 32 * 64 * rf.dtype_bytes  # E x (gate, up, down) x I x H
    assert rf.experts == ((8, 2, per_layer),) * 3
    assert rf.weight_bytes == total - 3 * per_layer
    assert rf.expert_bytes(1) == pytest.approx(3 * per_layer * 2 / 8)
    assert 3 * per_layer * 0.99 < rf.expert_bytes(64) < 3 * per_layer
    assert rf.decode_step_s([40]) == pytest.approx((rf.weight_bytes + rf.expert_bytes(1) + rf.kv_bytes(40)) / 1e12)
    assert rf.num_params * rf.dtype_bytes == rf.weight_bytes + 3 * per_layer * 2 // 8
    assert main(["bench", "latency", "--model", folder, "--device", "cpu", "--batch-size", "2", "--input-len", "8",
                 "--output-len", "4", "--num-iters", "1", "--num-iters-warmup", "0",
                 "--output-json", str(tmp_path / "lat.json")]) == 0
    assert "the roofline assumes uniform routing" in capsys.readouterr().out


def test_a_shape_cut_to_its_first_layers_runs_with_dummy_weights(tmp_path, capsys):
    """--num-layers N: the random model of --shape keeps its first N layers and every width
    (Llama-4-Scout's 48 layers fit no single GPU), its per-layer lists cut with it; `bench
    latency --load-format dummy` runs on a Llama-4 shape so cut (RoPE and NoPE layers, experts
    and a dense MLP, prompts longer than an attention chunk)."""
    from launch.bench.common import shape_config
    scout = shape_config("llama-4-scout", 8)
    assert (scout.num_hidden_layers, scout.hidden_size, scout.num_local_experts, scout.attention_chunk_size) == \
        (8, 5120, 16, 8192)
    assert scout.no_rope_layers == [1, 1, 1, 0] * 2 and scout.moe_layers == list(range(8))
    assert shape_config("qwen3.6-35b-a3b", 8).layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    nano = shape_config("nemotron-3-nano-30b-a3b", 6)
    assert nano.hybrid_override_pattern == "MEMEM*" and nano.layers_block_type[-2:] == ["linear_attention",
                                                                                       "full_attention"]
    jamba = shape_config("jamba-mini", 16)  # (Jamba's layout is periodic: nothing to cut but the count)
    assert (jamba.num_hidden_layers, jamba.hidden_size, jamba.num_experts, jamba.mamba_dt_rank) == (16, 4096, 16, 256)
    assert [i for i, t in enumerate(jamba.layers_block_type) if t == "attention"] == [4, 12]
    folder, out = tmp_path / "tl", tmp_path / "lat.json"
    args = ["bench", "latency", "--shape", "tiny-llama4", "--num-layers", "4", "--load-format", "dummy",
            "--device", "cpu", "--batch-size", "2", "--input-len", "20", "--output-len", "4", "--num-iters", "1",
            "--num-iters-warmup", "0", "--output-json", str(out)]
    assert main(args + ["--model-dir", str(folder)]) == 0
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 4 and cfg["architectures"] == ["Llama4ForCausalLM"]
    assert cfg["no_rope_layers"] == [1, 1, 1, 0] and cfg["moe_layers"] == [1, 3]
    assert not list(folder.glob("*.safetensors"))  # dummy weights: the config alone
    assert math.isfinite(json.loads(out.read_text())["results"][0]["decode_step_s"])
    assert main(args[:2] + ["--model", str(folder), "--num-layers", "4", "--device", "cpu"]) == 2
    assert "--num-layers changes a random model of --shape" in capsys.readouterr().err


def test_profile_decode_times_rounds_against_the_roofline(tiny, capsys):
    """`profile_decode` on CPU: each batch's rounds of timed steps against the roofline of the same
    run, then the profiled steps; bad arguments exit with status 2 before an engine starts."""
    from launch.bench.profile_decode import main as profile_decode
    assert profile_decode([tiny, "--batch", "1", "2", "--input-len", "8", "--rounds", "2", "--steps", "3",
                           "--profile-steps", "1", "--marginal", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    lines = re.findall(r"B=(\d) TP=1: decode step ([\d.-]+) ms \(2 x 3 steps, no profiler\) against a roofline of "
                       r"([\d.-]+) ms: ([\d.-]+)x", out)
    assert [b for b, *_ in lines] == ["1", "2"], out
    assert all(float(step.split("-")[0]) > 0 and float(roof.split("-")[0]) > 0 for _, step, roof, _ in lines)
    assert out.count("profiled: kernel time") == 2 and "share of the span" in out
    for bad in (["--rounds", "0"], ["--input-len", "60"]):
        with pytest.raises(SystemExit) as e:
            profile_decode([tiny, "--no-profile", "--max-model-len", "64", *bad])
        assert e.value.code == 2
    assert "exceed --max-model-len 64" in capsys.readouterr().err


def test_marginal_costs_split_the_span_between_kernels():
    """`profile_decode --marginal`: each kernel adds the time from the end of the kernel before to
    its own end (nothing when it ends first, an idle gap with its duration); the shares add up to
    the span, per step, by name and grid."""
    from launch.bench.profile_decode import marginal_costs
    ev = [dict(name="a", ts=0.0, dur=10.0, args=dict(grid=[4, 1, 1])),
          dict(name="b", ts=8.0, dur=5.0, args=dict(grid=[1, 1, 1])),    # overlaps a (PDL): adds 3
          dict(name="c", ts=9.0, dur=2.0, args=dict(grid=[1, 1, 1])),    # ends inside b: adds 0
          dict(name="a", ts=20.0, dur=10.0, args=dict(grid=[4, 1, 1])),  # after a gap of 7: adds 17
          dict(name="a", ts=30.0, dur=4.0, args=dict(grid=[8, 1, 1]))]   # another grid
    costs = {(c.name, c.grid): c for c in marginal_costs(ev, steps=2)}
    assert costs["a", (4, 1, 1)].marginal_us == 13.5 and costs["a", (4, 1, 1)].launches == 1.0
    assert costs["b", (1, 1, 1)].marginal_us == 1.5 and costs["c", (1, 1, 1)].marginal_us == 0.0
    assert costs["a", (8, 1, 1)].busy_us == 2.0
    assert sum(c.marginal_us for c in costs.values()) * 2 == 34.0
    assert marginal_costs(ev, 2)[0].name == "a"


def test_kernel_averages_count_each_kernel_once():
    """`profile_decode` / `profile_prefill`: a host operator reports its kernels' time as its own
    device time too (aten::mm beside the GEMM it launched); only device events are summed."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from launch.bench.profile_decode import device_us, kernel_averages
    events = [SimpleNamespace(key="aten::mm", device_type=DeviceType.CPU, self_device_time_total=5.0),
              SimpleNamespace(key="nvjet_gemm", device_type=DeviceType.CUDA, self_device_time_total=5.0),
              SimpleNamespace(key="cudaGraphLaunch", device_type=DeviceType.CPU, self_device_time_total=2.0),
              SimpleNamespace(key="_rms_norm_kernel", device_type=DeviceType.CUDA, self_device_time_total=2.0),
              SimpleNamespace(key="Memset", device_type=DeviceType.CUDA, self_device_time_total=0.0)]
    kept = kernel_averages(SimpleNamespace(key_averages=lambda: events))
    assert [e.key for e in kept] == ["nvjet_gemm", "_rms_norm_kernel"]
    assert sum(device_us(e) for e in kept) == 7.0
