"""`LLM` end to end on CPU against transformers' generate(): every architecture at TP=1; prefix
caching on and off; a pool so small that requests are preempted; a token budget so small that
prompts are chunked; bad input."""
from __future__ import annotations

import pytest
import torch

from distengine import LLM, SamplingParams
from tests.test_models import CONFIGS, HYBRIDS, build

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _folder(tmp_path_factory, name):
    hf, _ = build(name)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder)
    return hf, str(folder)


def _prompts(n=4, shared=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 300, (shared,), generator=g).tolist()
    return [system + torch.randint(0, 300, (5 + 3 * i,), generator=g).tolist() for i in range(n)]


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()


def _hf_greedy_prefixes(hf, prompts, lengths) -> dict[int, list[list[int]]]:
    """transformers' greedy tokens of each prompt at each length, from one generate() of the
    longest: its first n tokens are the n-token run's (EOS is held back through both)."""
    longest = [_hf_greedy(hf, p, max(lengths)) for p in prompts]
    return {n: [t[:n] for t in longest] for n in lengths}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _folder(tmp_path_factory, "qwen3")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_equals_transformers(tmp_path_factory, name):
    hf, folder = _folder(tmp_path_factory, name)
    prompts = _prompts()
    with LLM(folder, device="cpu", dtype="float32", block_size=4, max_model_len=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 12)
        assert o.finished and o.outputs[0].finish_reason == "length" and o.prompt_token_ids == p


def test_prefix_caching_preemption_and_chunking_change_nothing(qwen3):
    hf, folder = qwen3
    prompts = [{"prompt_token_ids": p} for p in _prompts(6, shared=40)]
    with LLM(folder, device="cpu", dtype="float32", block_size=4, max_model_len=128) as llm:
        base = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert base[0].num_cached_tokens == 0 and base[1].num_cached_tokens >= 40 - 4
    runs = {
        "no prefix caching": dict(enable_prefix_caching=False),
        "tiny pool (preemption)": dict(num_gpu_blocks_override=40),
        "tiny token budget (chunked prefill)": dict(max_num_batched_tokens=16),
    }
    for what, kw in runs.items():
        with LLM(folder, device="cpu", dtype="float32", block_size=4, max_model_len=128, **kw) as llm:
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            if "preemption" in what:
                assert llm.stats().preemptions > 0, what
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base], what


# Of the Gated DeltaNet families, each class once: Qwen3-Next (interleaved projections, experts
# without renormalisation), Qwen3.5 dense, and Qwen3.5-MoE through its multimodal checkpoint; the
# text-only MoE and the dense multimodal checkpoint share their paths and are checked against
# transformers in the tests above and below. Likewise the Mamba hybrids whose states and layers'
# order another variant of their class already takes through here (Falcon-H1 with its Mamba
# norm, Nemotron-H and Granite-4.0-H without experts) go to the TP=2 test below.
STATE_PATH_TWINS = {"falcon_h1_norm", "nemotron_h", "granitemoehybrid"}
HYBRID_FAMILIES = [h for h in HYBRIDS if h not in STATE_PATH_TWINS] + ["qwen3_next", "qwen3_5", "qwen3_5_moe_vl"]


@pytest.mark.parametrize("name", HYBRID_FAMILIES)
def test_hybrid_prefix_hits_preemption_and_chunking_give_transformers_tokens(tmp_path_factory, ray_cluster, name):
    """Mamba and Gated DeltaNet hybrids: a request sharing a prefix with an earlier one restores
    the cached states (num_cached_tokens > 0) and produces transformers' tokens; so do no prefix
    caching, a pool small enough to preempt, a token budget small enough to chunk prompts, and
    TP=2."""
    hf, folder = _folder(tmp_path_factory, name)
    kw = dict(device="cpu", dtype="float32", max_model_len=256)

    def run(llm, params=GREEDY):
        # The first request alone: the others find its prefix cached.
        first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
        return first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)

    with LLM(folder, **kw) as llm:
        plan = llm.plan
        # The plan picks the block size. A state is kept at the last block end of the first
        # prompt's prefill (2 blocks): inside the shared prefix of 2.5 blocks, so the others hit it.
        shared = 5 * plan.block_size // 2
        prompts = _prompts(5, shared=shared, seed=1)
        # Requests that grow by 48 tokens, to the max_model_len of a pool that holds one: they
        # preempt each other.
        grow = max(map(len, prompts)) + 48
        longer = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        want = _hf_greedy_prefixes(hf, prompts, (12, longer.max_tokens))
        outs = run(llm)
        assert outs[0].num_cached_tokens == 0
        assert all(o.num_cached_tokens == 2 * plan.block_size for o in outs[1:]), \
            (plan.block_size, [o.num_cached_tokens for o in outs])
        assert [o.outputs[0].token_ids for o in outs] == want[12]
    # Admission falls back from a prefix hit (whose state page it would hold) to computing from
    # scratch when the pool is that tight.
    pool = sum(plan.blocks_per_group(grow)) + 1
    runs = {
        "no prefix caching": (dict(enable_prefix_caching=False), GREEDY),
        "tiny pool (preemption)": (dict(num_gpu_blocks_override=pool, max_model_len=grow), longer),
        "tiny token budget (chunked prefill)": (dict(max_num_batched_tokens=16, mamba_checkpoint_interval=1), GREEDY),
        "TP=2, chunked": (dict(tensor_parallel_size=2, max_num_batched_tokens=24), GREEDY),
    }
    for what, (extra, params) in runs.items():
        with LLM(folder, **{**kw, **extra}) as llm:
            outs = run(llm, params)
            if "preemption" in what:
                assert llm.stats().preemptions > 0, what
            if "chunked" in what:
                assert outs[-1].num_cached_tokens > 0, what
        assert [o.outputs[0].token_ids for o in outs] == want[params.max_tokens], what


# Llama-4: chunked-local layers (chunks of 8 tokens) beside global NoPE layers and experts; the
# shared 26 tokens hit in whole 4-token blocks of every group (24). Gemma 4: layers of two page
# sizes (sliding: 2 KV heads of 16; full: 1 of 32 with k_eq_v, 2 of 32 without), the KV-sharing
# layers reading their targets' pages (gemma4), per-layer inputs, experts (gemma4_moe); its
# sliding groups bound the hit (> 0). Their multimodal checkpoints (llama4_vl, gemma4_vl) share
# these paths past the loader: they go through `LLM` against transformers in the TP=2 test below.
PREFIX_FAMILIES = [("llama4", 24), ("gemma4", None), ("gemma4_moe", None)]


@pytest.mark.parametrize("name, hit", PREFIX_FAMILIES)
def test_prefix_hits_preemption_and_chunking_give_transformers_tokens(tmp_path_factory, ray_cluster, name, hit):
    """Requests sharing a prefix hit it (num_cached_tokens > 0) and produce transformers' tokens;
    so do no prefix caching, a pool small enough to preempt requests that grow past many chunks or
    windows, a token budget small enough to chunk prompts, and TP=2 (with chunked prefill; a
    single KV head replicated)."""
    hf, folder = _folder(tmp_path_factory, name)
    kw = dict(device="cpu", dtype="float32", block_size=4, max_model_len=160)
    prompts = _prompts(4, shared=26, seed=3)
    # Requests that grow by 64 tokens (8 chunks of Llama-4's), to the max_model_len of the tiny pool.
    grow = max(map(len, prompts)) + 64
    longer = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    want = _hf_greedy_prefixes(hf, prompts, (12, longer.max_tokens))

    def run(llm, params=GREEDY):
        # The first request alone: the others find its prefix cached.
        first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
        return first + llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)

    with LLM(folder, **kw) as llm:
        plan = llm.plan
        outs = run(llm)
        assert outs[0].num_cached_tokens == 0
        cached = [o.num_cached_tokens for o in outs[1:]]
        assert all(c == hit if hit is not None else c > 0 for c in cached), cached
        assert [o.outputs[0].token_ids for o in outs] == want[12]
    # A pool that holds one request of `grow` tokens at its peak (prefill chunks of 16 tokens, the
    # chunked layers' groups holding a chunk beside their attention chunk) and not two.
    pool = sum(plan.peak_blocks_per_group(grow, 16)) + 1
    runs = {
        "no prefix caching": (dict(enable_prefix_caching=False), GREEDY),
        "tiny pool (preemption)": (dict(num_gpu_blocks_override=pool, max_num_batched_tokens=16, max_model_len=grow),
                                   longer),
        "tiny token budget (chunked prefill)": (dict(max_num_batched_tokens=11), GREEDY),
        "TP=2, chunked": (dict(tensor_parallel_size=2, max_num_batched_tokens=13), GREEDY),
    }
    if name == "gemma4_moe":
        # Gemma 4's attention layout and its pool are gemma4's, which runs these two: the experts
        # keep no state across steps, and this one's chunked and TP=2 runs stay.
        del runs["no prefix caching"], runs["tiny pool (preemption)"]
    for what, (extra, params) in runs.items():
        with LLM(folder, **{**kw, **extra}) as llm:
            outs = run(llm, params)
            if "preemption" in what:
                assert llm.stats().preemptions > 0, what
            if "chunked" in what:
                assert outs[-1].num_cached_tokens > 0, what
        assert [o.outputs[0].token_ids for o in outs] == want[params.max_tokens], what


def test_a_cache_too_small_for_a_prefill_chunk_is_refused_at_start(tmp_path_factory):
    """The start-up check counts a request's peak: a sliding-window group holds a whole prefill
    chunk's blocks beside its window. 100 blocks of 4 tokens hold one 128-token request at its
    end (32 full blocks + 5 x 4 sliding), not its prefill in one 128-token chunk (6 x 32): refused
    before anything runs, not a request that can never be scheduled. With 16-token chunks it fits
    and runs to transformers' tokens."""
    from distengine.kv_cache.sizing import KVCacheTooSmallError
    hf, folder = _folder(tmp_path_factory, "gemma3")
    kw = dict(device="cpu", dtype="float32", block_size=4, max_model_len=128, num_gpu_blocks_override=100)
    with pytest.raises(KVCacheTooSmallError, match="needs 193 .* prefill chunks of up to 128 tokens"):
        LLM(folder, **kw)
    prompt = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(5)).tolist()
    with LLM(folder, max_num_batched_tokens=16, **kw) as llm:
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
    assert out[0].outputs[0].token_ids == _hf_greedy(hf, prompt, 8)


def test_bad_input_is_refused_cleanly(qwen3):
    _, folder = qwen3
    with LLM(folder, device="cpu", dtype="float32", block_size=4, max_model_len=64) as llm:
        with pytest.raises(ValueError, match=r"70 tokens.*max_model_len is 64"):
            llm.generate([{"prompt_token_ids": [1] * 10}, {"prompt_token_ids": [1] * 70}], GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate("hello", GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=-1)
        assert llm.scheduler.manager.num_free_blocks == llm.scheduler.manager.pool.num_blocks - 1
        assert not llm.scheduler.has_unfinished()
        # The engine still works after refusing bad input.
        out = llm.generate({"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3


def test_logit_bias_allowed_tokens_and_min_tokens_through_the_engine(qwen3):
    """Through the persistent batch, beside requests that ask for nothing: a +100 bias makes its
    token the greedy choice; allowed_token_ids keeps sampled tokens on the list; min_tokens
    bars a stop token that would end the request at once; a bias token outside the vocabulary
    is refused by name, and nothing is left behind."""
    _, folder = qwen3
    prompt = {"prompt_token_ids": [3, 4, 5, 6]}
    with LLM(folder, device="cpu", dtype="float32", block_size=4, max_model_len=64) as llm:
        plain = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].outputs[0]
        first = plain.token_ids[0]
        params = [SamplingParams(max_tokens=6, temperature=0, logit_bias={17: 100.0}),
                  SamplingParams(max_tokens=6, temperature=1.0, seed=3, allowed_token_ids=[9, 11, 40]),
                  SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[first]),
                  SamplingParams(max_tokens=6, temperature=0, stop_token_ids=[first], min_tokens=3),
                  SamplingParams(max_tokens=6, temperature=0)]
        outs = [o.outputs[0].token_ids for o in llm.generate([prompt] * 5, params, use_tqdm=False)]
        assert outs[0] == [17] * 6
        assert set(outs[1]) <= {9, 11, 40} and len(outs[1]) == 6
        assert outs[2] == [first]
        assert len(outs[3]) >= 4 and first not in outs[3][:3]
        assert outs[4] == plain.token_ids
        with pytest.raises(ValueError, match=r"logit_bias \(its keys\)\[0\] = 10000000 is not a token id"):
            llm.generate(prompt, SamplingParams(logit_bias={10_000_000: 1.0}), use_tqdm=False)
        assert llm.scheduler.manager.num_free_blocks == llm.scheduler.manager.pool.num_blocks - 1


def _beam_search_oracle(hf, prompt, width, steps, eos):
    """vLLM's beam search rule on transformers' float32 log-softmax: extend each beam by its
    2 x width best tokens, keep the width best by cum / length (EOS not counted)."""
    def score(b):
        tokens, cum = b
        return cum / (len(tokens) - (1 if tokens[-1] in eos else 0))
    beams, done = [(list(prompt), 0.0)], []
    for _ in range(steps):
        grown = []
        for tokens, cum in beams:
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].double(), -1)
            top = lp.topk(2 * width)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                (done if t in eos else grown).append((tokens + [t], cum + v))
        beams = sorted(grown, key=score, reverse=True)[:width]
    return sorted(done + beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_several_completions_share_the_prompt_and_beam_search(tmp_path_factory, name):
    """n completions are the n=1 requests of seeds seed .. seed + n - 1, computed on the prompt's
    shared blocks (each child hits the whole blocks a hidden request computed once, Gated DeltaNet
    state included); best_of keeps the n of highest cumulative logprob; beam search gives the
    beams of vLLM's rule evaluated on transformers' logits."""
    from distengine.beam_search import BeamSearchParams
    hf, folder = _folder(tmp_path_factory, name)
    prompt = _prompts(1, shared=30)[0]
    with LLM(folder, device="cpu", dtype="float32", block_size=4, max_model_len=128) as llm:
        block = llm.plan.block_size
        sp = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
        got = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
        assert [c.index for c in got.outputs] == [0, 1, 2]
        assert got.num_cached_tokens == (len(prompt) - 1) // block * block > 0
        alone = llm.generate([{"prompt_token_ids": prompt}] * 3,
                             [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=6, ignore_eos=True)
                              for i in range(3)], use_tqdm=False)
        assert [c.token_ids for c in got.outputs] == [o.outputs[0].token_ids for o in alone]
        best = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=2, best_of=5, temperature=1.0, seed=1,
                                                                          max_tokens=4, ignore_eos=True),
                            use_tqdm=False)[0].outputs
        five = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=5, temperature=1.0, seed=1, max_tokens=4,
                                                                          ignore_eos=True, logprobs=0),
                            use_tqdm=False)[0].outputs
        ranked = sorted(five, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
        assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
        assert best[0].logprobs is None and best[0].cumulative_logprob is None and [c.index for c in best] == [0, 1]
        beams = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=2, max_tokens=3))[0]
        want = _beam_search_oracle(hf, prompt, 2, 3, llm.eos_token_ids)
        assert [b.tokens for b in beams.sequences] == [t for t, _ in want]
        for b, (_, cum) in zip(beams.sequences, want):
            assert abs(b.cum_logprob - cum) < 1e-4
        assert llm.scheduler.manager.num_free_blocks == llm.scheduler.manager.pool.num_blocks - 1


@pytest.mark.parametrize("tp", [1, 2])
def test_prompt_logprobs_equal_transformers(qwen3, ray_cluster, tp):
    """Each prompt token's logprob given the tokens before it, its rank and the top 3, against
    transformers' log-softmax: with prefill chunks, beside a request without them, and for a
    prompt the prefix cache holds (the prompt is computed again: its positions need logits)."""
    hf, folder = qwen3
    prompt = _prompts(1, shared=30)[0]
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
    kw = dict(tensor_parallel_size=tp, device="cpu", dtype="float32", block_size=4, max_model_len=128,
              max_num_batched_tokens=16)
    sp = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    with LLM(folder, **kw) as llm:
        outs = llm.generate([{"prompt_token_ids": prompt}] * 2, [sp, SamplingParams(max_tokens=2)], use_tqdm=False)
        again = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
    got, ranks = outs[0].prompt_logprobs, outs[0].prompt_logprob_ranks
    assert outs[1].prompt_logprobs is None and got[0] is None and ranks[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        row = want[i - 1]
        assert abs(got[i][prompt[i]] - row[prompt[i]].item()) < 1e-4
        assert ranks[i] == int((row > row[prompt[i]]).sum()) + 1
        top = row.topk(3).indices.tolist()
        assert set(got[i]) == {prompt[i], *top}
    assert again.num_cached_tokens == 0 and len(again.prompt_logprobs) == len(got)
    for a, b in zip(again.prompt_logprobs[1:], got[1:]):  # (another batch: sums in another order)
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-5 for t in a)


# Every family's sharded layers are compared with transformers at TP=2 on gloo
# (tests/test_tensor_parallel.py); through the engine on Ray, the two tests above run each hybrid
# and prefix family at TP=2, and this one the attention layouts they do not: soft-capping and
# sliding windows (Gemma 2), the 5:1 local/global rotaries (Gemma 3), sinks with experts
# (gpt-oss), chunked-local and NoPE layers in the multimodal checkpoint's layout (Llama-4).
# The other families share their engine path with one of these (their TP=2 run on Ray was
# about 13 s each on two CPU cores, for no path of its own).
TP2_RAY_FAMILIES = ["gemma2", "gemma3", "gpt_oss", "llama4_vl"]


@pytest.mark.parametrize("name", TP2_RAY_FAMILIES)
def test_tp2_on_ray_equals_transformers(tmp_path_factory, ray_cluster, name):
    hf, folder = _folder(tmp_path_factory, name)
    prompts = _prompts(3)
    with LLM(folder, tensor_parallel_size=2, device="cpu", dtype="float32", block_size=4, max_model_len=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert llm.scheduler.max_num_batched_tokens == 2048  # as both ranks resolved it on their CPUs
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _hf_greedy(hf, p, 12)


def test_killed_worker_makes_generate_raise(qwen3, ray_cluster):
    import time

    from distengine.executor import EngineDeadError
    _, folder = qwen3
    llm = LLM(folder, tensor_parallel_size=2, device="cpu", dtype="float32", block_size=4, max_model_len=128)
    try:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)
        ray_cluster.kill(llm.executor.actors[1])
        t = time.perf_counter()
        with pytest.raises(EngineDeadError):
            llm.generate([{"prompt_token_ids": p} for p in _prompts(2)], GREEDY, use_tqdm=False)
        assert time.perf_counter() - t < 30
        with pytest.raises(EngineDeadError):  # and it stays dead
            llm.generate({"prompt_token_ids": [1, 2]}, GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


def test_bad_words_with_and_without_preemption(tmp_path):
    """vLLM's bad_words through the engine: a one-token word never comes; a two-token phrase's
    second word never follows its first, also when the requests are preempted and resumed (the
    rows' rings of outputs are rebuilt from the outputs so far); a word too long is refused."""
    from launch.demo import build_model
    build_model(str(tmp_path))
    kw = dict(device="cpu", dtype="float32", block_size=4, max_model_len=40)
    prompts = ["what is water", "who made oil", "what is oil made of", "who is water"] * 2
    plain = SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    with LLM(str(tmp_path), **kw) as llm:
        free = llm.generate(prompts, plain, use_tqdm=False)
        toks = free[0].outputs[0].token_ids
        first, second = free[0].outputs[0].text.split()[:2]
        phrase = [SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, bad_words=[f"{first} {second}"])]
        base = llm.generate(prompts, phrase * len(prompts), use_tqdm=False)
        single = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                         bad_words=[first]), use_tqdm=False)[0].outputs[0]
        with pytest.raises(ValueError, match="at most 16"):
            llm.generate(prompts[0], SamplingParams(bad_words=[" ".join(["water"] * 17)]), use_tqdm=False)
    a, b = llm.tokenizer.encode(first, add_special_tokens=False)[0], llm.tokenizer.encode(second, add_special_tokens=False)[0]
    assert toks[:2] == [a, b]
    assert a not in single.token_ids
    for o in base:
        t = o.outputs[0].token_ids
        assert not any(x == a and y == b for x, y in zip(t, t[1:])), t
    with LLM(str(tmp_path), num_gpu_blocks_override=90, **kw) as llm:
        tight = llm.generate(prompts, phrase * len(prompts), use_tqdm=False)
        assert llm.stats().preemptions > 0
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in base]


def test_chat_text_stop_strings_and_logprobs(tmp_path):
    """A model with a real (tiny, local) tokenizer and a chat template: text prompts, chat(),
    stop strings cut the text, logprobs hold the sampled token and the top-k."""
    from launch.demo import build_model
    from transformers import AutoTokenizer
    build_model(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    tok.chat_template = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant :"
    tok.save_pretrained(str(tmp_path))
    with LLM(str(tmp_path), device="cpu", dtype="float32", block_size=16, max_model_len=256) as llm:
        greedy = llm.generate("what is water", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
        assert greedy.text == tok.decode(greedy.token_ids)
        stop_word = greedy.text.split()[2]
        cut = llm.generate("what is water", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                           stop=[stop_word]), use_tqdm=False)[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop_word and stop_word not in cut.text
        assert greedy.text.startswith(cut.text)
        chat = llm.chat([{"role": "user", "content": "what is water"}],
                        SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
        assert chat.prompt == "user : what is water assistant :"
        lp = chat.outputs[0].logprobs
        assert len(lp) == 4 and all(len(d) >= 3 and t in d for d, t in zip(lp, chat.outputs[0].token_ids))
        # Greedy: the sampled token is the most likely one.
        assert all(d[t] == max(d.values()) for d, t in zip(lp, chat.outputs[0].token_ids))


def test_generate_command(tmp_path, capsys):
    from launch.cli import main
    from launch.demo import build_model
    build_model(str(tmp_path))
    assert main(["generate", "--model", str(tmp_path), "--prompt", "what is water", "--prompt", "who made oil",
                 "--max-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "'what is water'" in out and "'who made oil'" in out


def test_default_token_budget_follows_the_device():
    """vLLM's default budget: 8192 tokens on a GPU of 70 GiB or more other than an A100, else 2048;
    never below max_model_len (up to 8192) or max_num_seqs; an explicit one is kept; ranks of
    different GPUs take the least."""
    from distengine.config import EngineConfig
    from distengine.worker_info import DeviceInfo
    h200, a100 = DeviceInfo(0, "cuda:0", "NVIDIA H200", 143 << 30), DeviceInfo(0, "cuda:0", "NVIDIA A100-SXM4-80GB", 80 << 30)
    l4, cpu = DeviceInfo(0, "cuda:0", "NVIDIA L4", 24 << 30), DeviceInfo(0, "cpu", "CPU", 0)

    def budget(devices, **options) -> int:
        config = EngineConfig(model="m", **{"max_model_len": 32768, **options})
        return config.with_token_budget(devices).max_num_batched_tokens
    assert [budget([d]) for d in (h200, a100, l4, cpu)] == [8192, 2048, 2048, 2048]
    assert budget([cpu], max_model_len=4096) == 4096 and budget([h200], max_model_len=4096) == 8192
    assert budget([l4], max_num_seqs=3000) == 3000
    assert budget([h200], max_num_batched_tokens=512) == 512
    assert budget([h200, h200]) == 8192 and budget([h200, l4]) == 2048


def test_scheduler_takes_the_budget_the_engine_resolved(qwen3):
    _, folder = qwen3
    with LLM(folder, device="cpu", max_model_len=128) as llm:
        assert llm.info.config.max_num_batched_tokens == 2048
        assert llm.scheduler.max_num_batched_tokens == 2048
    with LLM(folder, device="cpu", max_model_len=128, max_num_batched_tokens=40) as llm:
        assert llm.scheduler.max_num_batched_tokens == 40 == llm.info.config.max_num_batched_tokens
