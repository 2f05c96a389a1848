"""The runner end to end on CPU: a checkpoint folder loaded by our loader, steps from the real
scheduler (new requests once, then only new tokens and new blocks), a prefill batched with
decodes, with and without overlapped steps; greedy output equals transformers' generate().
Engine options that the model cannot serve are refused before anything starts."""
from __future__ import annotations

import json

import pytest
import torch

from distengine.config import EngineConfig
from distengine.engine_core import EngineCore
from distengine.executor import UniprocExecutor
from distengine.sampling_params import SamplingParams
from distengine.scheduler import EngineRequest
from distengine.step import ScheduledRequest, StepPlan
from tests.conftest import DEVICE
from tests.test_models import build
from distengine.hf_config import load_hf_config, text_config
from distengine.kv_cache.sizing import KVCacheTooSmallError, check_fits, engine_plan, num_blocks
from workers.model_runner import ModelRunner


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf, _ = build("qwen3")
    folder = tmp_path_factory.mktemp("qwen3")
    hf.save_pretrained(folder, max_shard_size="200KB")  # several shards and an index
    return hf, str(folder)


def config(folder: str, **kw) -> EngineConfig:
    return EngineConfig.create(folder, **{**dict(device=DEVICE, dtype="float32", block_size=4, max_model_len=256,
                                                 num_gpu_blocks_override=400), **kw})


@pytest.mark.parametrize("overlap", [False, True])
def test_runner_greedy_with_mixed_batches_matches_generate(checkpoint, overlap):
    hf, folder = checkpoint
    cfg = config(folder, async_scheduling=overlap, debug_checks=True)
    core = EngineCore(cfg, UniprocExecutor(cfg))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (23, 31)]
    reqs = [EngineRequest(f"r{i}", p, sampling=SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
            for i, p in enumerate(prompts)]
    core.add_request(reqs[0])
    for n in range(100):
        if n == 3:  # the second request's prefill joins the first one's decodes
            core.add_request(reqs[1])
        if n > 3 and not core.has_unfinished() and not core.scheduler.has_in_flight():
            break
        core.step()
    core.shutdown()
    for req, prompt in zip(reqs, prompts):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                               attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
        assert req.output_token_ids == want


def runner_of(cfg: EngineConfig) -> tuple[ModelRunner, EngineConfig]:
    """A runner as the engine builds one: the config placed and its budget resolved, the plan made
    on the driver."""
    cfg = cfg.placed(DEVICE == "cuda").with_token_budget([])
    text = text_config(load_hf_config(cfg.model)).to_dict()
    return ModelRunner(cfg, engine_plan(cfg, text)), cfg


def test_too_small_cache_says_what_fits(checkpoint):
    _, folder = checkpoint
    runner, cfg = runner_of(config(folder, device="cpu"))
    with pytest.raises(KVCacheTooSmallError, match=r"max_model_len <= \d+"):
        check_fits(cfg, runner.plan, 20, on_gpu=False)
    with pytest.raises(KVCacheTooSmallError, match=r"max_model_len <= \d+"):
        EngineCore(config(folder, device="cpu", num_gpu_blocks_override=20))


def test_unknown_request_is_refused(checkpoint):
    _, folder = checkpoint
    runner, _ = runner_of(config(folder, device="cpu"))
    runner.allocate_kv_cache(200)
    with pytest.raises(KeyError, match="never sent"):
        runner.execute(StepPlan(0, scheduled=[ScheduledRequest("x", 0, 1, [1], [], True)]))


def test_num_blocks_from_memory(checkpoint, monkeypatch):
    """CPU: kv_cache_memory_bytes, else VLLM_CPU_KVCACHE_SPACE (GiB), else 1 GiB; GPU: what is left
    after a profiling pass at the largest batch. Too little gets advice that fits the device."""
    _, folder = checkpoint

    def blocks(cfg: EngineConfig) -> int:
        runner, cfg = runner_of(cfg)
        return num_blocks(cfg, runner.plan, [runner.profile_memory()], DEVICE == "cuda")

    runner, _ = runner_of(config(folder))
    block_bytes = runner.plan.block_bytes
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # (tests/conftest.py sets a small one)
    n = blocks(config(folder, gpu_memory_utilization=0.3, kv_cache_memory_bytes=None, num_gpu_blocks_override=None))
    if DEVICE == "cpu":
        assert n == (1 << 30) // block_bytes
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.01")
        assert blocks(config(folder, num_gpu_blocks_override=None)) == int(0.01 * (1 << 30)) // block_bytes
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
        with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE must be a number of GiB"):
            config(folder)
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
        with pytest.raises(KVCacheTooSmallError, match=r"raise kv_cache_memory_bytes \(or VLLM_CPU_KVCACHE_SPACE"):
            blocks(config(folder, kv_cache_memory_bytes=100_000, num_gpu_blocks_override=None))
    else:
        free, total = torch.cuda.mem_get_info()
        assert 0 < n * block_bytes < 0.3 * total
        with pytest.raises(KVCacheTooSmallError, match="raise gpu_memory_utilization"):
            blocks(config(folder, gpu_memory_utilization=1e-9, num_gpu_blocks_override=None))


def test_max_model_len_beyond_the_positions_is_refused(checkpoint, tmp_path):
    """As vLLM: at LLM(...) / EngineConfig.create, with both numbers, before any worker starts
    (a prompt past the positions would read beyond the rotary cache)."""
    from distengine import LLM
    _, folder = checkpoint  # max_position_embeddings=512, no rope scaling
    with pytest.raises(ValueError, match=r"max_model_len \(1024\).*positions allow \(512: max_position_embeddings"):
        EngineConfig.create(folder, device="cpu", max_model_len=1024)
    with pytest.raises(ValueError, match=r"max_model_len \(32768\).*\(512"):
        LLM(folder, device="cpu", max_model_len=32768)
    assert EngineConfig.create(folder, device="cpu").max_model_len == 512
    # Linear rope scaling extends the positions by its factor; the rotary cache follows max_model_len.
    scaled = tmp_path / "scaled"
    scaled.mkdir()
    with open(f"{folder}/config.json") as f:
        cfg = json.load(f)
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    cfg.pop("rope_parameters", None)
    (scaled / "config.json").write_text(json.dumps(cfg))
    assert EngineConfig.create(str(scaled), device="cpu", max_model_len=2048).max_model_len == 2048
    with pytest.raises(ValueError, match=r"\(2049\).*\(2048: max_position_embeddings=512 with linear"):
        EngineConfig.create(str(scaled), device="cpu", max_model_len=2049)


def test_engine_options_are_checked(checkpoint):
    _, folder = checkpoint
    for kw, match in ((dict(tensor_parallel_size=0), "tensor_parallel_size"), (dict(block_size="16"), "block_size"),
                      (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"), (dict(device="tpu"), "device"),
                      (dict(max_num_seqs=0), "max_num_seqs"), (dict(cuda_graph_sizes=(0, 4)), "cuda_graph_sizes"),
                      (dict(placement_strategy="X"), "placement_strategy"), (dict(bogus=1), "bogus")):
        with pytest.raises((ValueError, TypeError), match=match):
            EngineConfig.create(folder, **kw)
    if not torch.cuda.is_available():  # refused at once, not inside a worker
        with pytest.raises(ValueError, match=r"device='cuda' but this machine has no CUDA GPU"):
            EngineConfig.create(folder, device="cuda")
    else:
        with pytest.raises(ValueError, match="cuda:99"):
            EngineConfig.create(folder, device="cuda:99")
    for kw, match in ((dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes"),
                      (dict(kv_cache_memory_bytes=1.5), "kv_cache_memory_bytes")):
        with pytest.raises((ValueError, TypeError), match=match):
            EngineConfig.create(folder, **kw)
