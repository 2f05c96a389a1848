"""On a GPU (skipped without one): a decode CUDA graph's replay equals the same forward run eagerly,
bit for bit; the engine with graphs gives the tokens of the engine without (greedy, seeded
sampling, penalties; batches padded to every captured size); no Triton kernel is compiled again
after warm-up over a 300-token decode, with graphs and eagerly; the graphs' memory is counted
before the KV cache is sized. With two GPUs: TP=2 on Ray, with its all-reduces inside the graphs
(NCCL's, then the NVLink kernel fused with the norms), gives transformers' greedy tokens. Each
on Gemma-3, on a Mamba hybrid (Bamba: the state pages of a decode are found on the device,
inside the graph), on Granite-4.0-H with routed experts (their sort by expert inside the graph),
on gpt-oss (sinks, biases, experts with biases), on Qwen3.5-MoE (Gated DeltaNet states updated
in place, gated attention, experts beside a gated shared expert), on Llama-4 (chunked-local
layers, the NoPE layers' query scale from the positions, experts scored on their input) and on
Jamba (Mamba-1 states updated in place, experts weighed by their softmax over all experts)."""
from __future__ import annotations

import pytest
import torch

from distengine import LLM, SamplingParams
from kernels import compiled_variants
from tests.test_models import build

pytestmark = pytest.mark.gpu
# The KV cache is sized from gpu_memory_utilization, as a user's would be: a tiny model's 512-byte
# blocks number ~84 million on an H200, which the pool holds without building them (lazy blocks).
ARGS = dict(device="cuda", dtype="float32", block_size=4, max_model_len=256, max_num_seqs=8,
            gpu_memory_utilization=0.3)


@pytest.fixture(scope="module", params=["gemma3", "bamba", "granitemoehybrid_moe", "gpt_oss", "qwen3_5_moe",
                                                "llama4", "nemotron_h_moe", "gemma4", "jamba"])
def model(request, tmp_path_factory):
    hf, _ = build(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, str(folder)


def _prompts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 300, (5 + 7 * i,), generator=g).tolist()} for i in range(n)]


def _params(n: int) -> list[SamplingParams]:
    """Staggered lengths (the batch shrinks through every graph size), greedy and not."""
    out = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i, ignore_eos=True) for i in range(n)]
    out[1] = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True)
    out[2] = SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=30,
                            ignore_eos=True)
    return out


def test_graph_replay_equals_the_eager_forward(model):
    _, folder = model
    with LLM(folder, **ARGS) as llm:
        runner = llm.executor.worker.runner
        assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8]
        llm.generate(_prompts(5), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        # The fixed inputs still hold the last decode step (5 sequences in the graph of 8). A
        # Mamba layer updates its state in place: both runs start from the same pool.
        pool = runner.kv_pool.clone()
        for size in (8, 4):
            graph = runner.graphs.replay(size).clone()
            runner.kv_pool.copy_(pool)
            with torch.no_grad():
                eager = runner._decode_forward(size)
            runner.kv_pool.copy_(pool)
            assert torch.equal(graph, eager), size
        # Let the engine's shutdown free the runner and the pool's copy (~40 GiB at this
        # utilization): held past it, they were still alive when the next test's engine sized
        # its KV cache (its profiling peak read 41 GiB) and it found no room.
        del runner, pool, graph, eager


def test_graphs_give_the_tokens_of_eager(model):
    """... also with logit adjustments (a bias, allowed tokens, min_tokens barring a stop token)
    and prompt logprobs on the device, which the two runs give alike."""
    _, folder = model
    prompts, params = _prompts(7), _params(7)
    params[3] = SamplingParams(temperature=0.0, max_tokens=20, logit_bias={5: 3.0}, allowed_token_ids=list(range(100)),
                               min_tokens=6, stop_token_ids=[7, 9], ignore_eos=True)
    params[4] = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2, ignore_eos=True)
    runs, prompt_lps = {}, {}
    for eager in (True, False):
        with LLM(folder, enforce_eager=eager, **ARGS) as llm:
            info = llm.info
            assert info.uses_cuda_graphs != eager and (llm.executor.worker.runner.graphs is None) == eager
            if not eager:
                assert info.memory[0].graph_bytes > 0  # counted before the KV cache was sized
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs[eager] = [o.outputs[0].token_ids for o in outs]
            prompt_lps[eager] = outs[4].prompt_logprobs
    assert runs[True] == runs[False]
    assert all(t < 100 for t in runs[True][3]) and not {7, 9} & set(runs[True][3][:6])
    assert len(prompt_lps[True]) == len(prompts[4]["prompt_token_ids"]) and prompt_lps[True] == prompt_lps[False]


def test_pdl_on_and_off_give_the_same_tokens(model, monkeypatch):
    """Programmatic dependent launch (kernels/pdl.py) changes when kernels start, never what they
    compute: the engine gives the same tokens with it and without (graphs and eager steps)."""
    import kernels.pdl as pdl
    _, folder = model
    if not pdl.pdl_enabled(torch.empty(1, device="cuda")):
        pytest.skip("PDL needs compute capability 9.0 or later (and DISTENGINE_PDL unset or 1)")
    outs = []
    for enabled in (True, False):
        monkeypatch.setattr(pdl, "ENABLED", enabled)
        with LLM(folder, **ARGS) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(_prompts(5), _params(5), use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("eager", [False, True])
def test_no_recompiles_after_warmup(model, eager):
    _, folder = model
    with LLM(folder, **{**ARGS, "dtype": "bfloat16", "max_model_len": 512}, enforce_eager=eager) as llm:
        llm.generate(_prompts(2, seed=1), SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                     use_tqdm=False)
        before = compiled_variants()
        outs = llm.generate(_prompts(3, seed=2), SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True),
                            use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 300 for o in outs)
        assert compiled_variants() == before, "a kernel was compiled again during the decode"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("all_reduce", ["nccl", "nvlink"])
def test_tp2_on_ray_with_cuda_graphs_equals_transformers(model, all_reduce):
    hf, folder = model
    prompts = _prompts(4)
    with LLM(folder, tensor_parallel_size=2, disable_custom_all_reduce=all_reduce == "nccl", **ARGS) as llm:
        assert llm.info.uses_cuda_graphs
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    ref = hf.to("cuda")
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p["prompt_token_ids"]], device="cuda")
        with torch.no_grad():
            want = ref.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                  attention_mask=torch.ones_like(ids))[0, ids.shape[1]:].tolist()
        assert o.outputs[0].token_ids == want
