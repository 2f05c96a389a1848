"""Tests for workers/sampler.py (CPU; also valid on CUDA)."""
from __future__ import annotations

import inspect

import pytest
import torch

from distengine.sampling_params import SamplingParams
from distengine.step import RequestSampling
from workers import sampler as S
from workers.sampler import SamplingTensors, apply_penalties, sample, seeded_uniform

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def P(**kw) -> RequestSampling:
    """A request's record as the workers get it (checked and normalised on the driver)."""
    return SamplingParams(**kw).for_workers()


def build(params, vocab, prompts=None, outputs=None):
    n = len(params)
    return SamplingTensors.build(params, prompts or [[] for _ in range(n)],
                                 outputs or [[] for _ in range(n)], vocab, DEV)


def logits_from_probs(probs, n=1):
    return torch.tensor(probs, dtype=torch.float32, device=DEV).log().expand(n, -1).contiguous()


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.to("cpu"), minlength=vocab).double() / tokens.numel()


def chi_square(tokens: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson chi-square over the tokens with expected_p > 0; asserts none fall outside."""
    counts = torch.bincount(tokens.to("cpu"), minlength=len(expected_p)).double()
    support = expected_p > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    exp = expected_p[support].double() * tokens.numel()
    return float(((counts[support] - exp) ** 2 / exp).sum())


# --------------------------------------------------------------------------- logit adjustments

def test_logit_bias_allowed_tokens_and_min_tokens():
    """logit_bias moves the greedy choice; allowed_token_ids keeps the draws (and the logprobs)
    on its tokens; min_tokens bars the stop tokens (EOS unless ignore_eos, and stop_token_ids)
    until the row has that many outputs; rows that ask for nothing are untouched."""
    v = 16
    logits = torch.randn(6, v, device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    top = int(logits[0].argmax())
    second = int(logits[2].topk(2).indices[1])
    params = [SamplingParams(temperature=0, logit_bias={3: 100.0}).for_workers(),
              SamplingParams(temperature=1.0, seed=1, allowed_token_ids=[5, 7], logprobs=2).for_workers(),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[int(logits[2].argmax())]).for_workers(),
              SamplingParams(temperature=0, min_tokens=2).for_workers(eos_token_ids=[int(logits[3].argmax())]),
              SamplingParams(temperature=0, min_tokens=2, ignore_eos=True).for_workers(
                  eos_token_ids=[int(logits[4].argmax())]),
              P(temperature=0)]
    outputs = [[], [], [1], [1, 2], [], []]
    out = sample(logits, build(params, v, outputs=outputs))
    got = out.token_ids.tolist()
    assert got[0] == 3 and got[0] != top or top == 3
    assert got[1] in (5, 7)
    assert set(out.top_token_ids[1].tolist()) == {5, 7}
    assert torch.isinf(out.top_logprobs[1]).sum() == 0 and torch.isfinite(out.logprobs[1])
    assert got[2] == second  # one output so far: its stop token is still barred
    assert got[3] == int(logits[3].argmax())  # two outputs: EOS may come
    assert got[4] == int(logits[4].argmax())  # ignore_eos: EOS is no stop token, never barred
    assert got[5] == int(logits[5].argmax())
    draws = [sample(torch.zeros(1, v, device=DEV), build([SamplingParams(temperature=1.0, seed=s, allowed_token_ids=[5, 7])
                                        .for_workers()], v)).token_ids.item() for s in range(40)]
    assert set(draws) == {5, 7}


def test_bad_words_bar_their_last_token_after_the_rest():
    """A one-token bad word is barred always; a longer one's last token only right after the
    word's other tokens, read from the row's ring of its last outputs (which wraps)."""
    from workers.sampler import HISTORY

    v = 12
    logits = torch.zeros(5, v, device=DEV)
    logits[:, 7] = 5.0  # every row's greedy choice, unless barred
    logits[:, 3] = 4.0  # the next best

    def rec(words):
        r = P(temperature=0)
        return RequestSampling(**{**r.__dict__, "bad_words": words})
    params = [rec([(7,)]), rec([(2, 9, 7)]), rec([(2, 9, 7)]), rec([(2, 9, 7)]), rec([(5, 7)])]
    long = list(range(1, 1 + HISTORY)) + [2, 9]  # the ring wrapped before the word's first tokens
    outputs = [[1], [4, 2, 9], [2, 4, 9], long, [5, 5, 8]]
    got = sample(logits, build(params, v, outputs=outputs)).token_ids.tolist()
    assert got == [3, 3, 7, 3, 7]


def test_min_tokens_record_names_its_stop_tokens():
    r = SamplingParams(min_tokens=3, stop_token_ids=[9, 4]).for_workers(eos_token_ids=frozenset({2}))
    assert r.stop_ids == (2, 4, 9) and r.adjusts_logits
    assert SamplingParams(min_tokens=3, ignore_eos=True).for_workers(eos_token_ids=[2]).stop_ids == ()
    assert not SamplingParams(stop_token_ids=[4]).for_workers(eos_token_ids=[2]).adjusts_logits


# --------------------------------------------------------------------------- greedy / temperature

def test_greedy_equals_argmax():
    torch.manual_seed(0)
    logits = torch.randn(7, 50, device=DEV)
    t = build([P(temperature=0.0) for _ in range(7)], 50)
    assert t.all_greedy
    out = sample(logits, t)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64
    assert out.logprobs is None and out.top_logprobs is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_greedy_any_dtype_and_input_untouched(dtype):
    torch.manual_seed(1)
    logits = torch.randn(4, 33, device=DEV).to(dtype)
    before = logits.clone()
    t = build([P(temperature=0.0, repetition_penalty=1.3), P(temperature=0.7),
               P(temperature=0.0), P(temperature=1.0, top_p=0.5)], 33,
              outputs=[[1, 2], [3], [], [4]])
    out = sample(logits, t)
    assert torch.equal(logits, before)
    assert out.token_ids.shape == (4,)
    assert out.token_ids[2] == logits[2].float().argmax()


def test_mixed_batch_greedy_rows_are_argmax():
    torch.manual_seed(2)
    logits = torch.randn(6, 40, device=DEV)
    params = [P(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = sample(logits, build(params, 40))
    assert torch.equal(out.token_ids[0::2], logits[0::2].argmax(-1))


def test_temperature_to_zero_approaches_greedy():
    torch.manual_seed(3)
    logits = torch.randn(64, 30, device=DEV)
    greedy = logits.argmax(-1)
    matches = []
    for temp in (2.0, 0.5, 0.1, 1e-3):
        out = sample(logits, build([P(temperature=temp) for _ in range(64)], 30))
        matches.append(float((out.token_ids == greedy).double().mean()))
    assert matches[-1] == 1.0
    assert matches[0] < matches[-1]
    assert matches[2] > 0.8


def test_top_k_1_equals_greedy():
    torch.manual_seed(4)
    logits = torch.randn(32, 100, device=DEV)
    for seed in (None, 5):
        out = sample(logits, build([P(top_k=1, temperature=1.3, seed=seed) for _ in range(32)], 100))
        assert torch.equal(out.token_ids, logits.argmax(-1))


# --------------------------------------------------------------------------- top-k / top-p / min-p

def test_top_k_distribution():
    torch.manual_seed(5)
    probs = [0.05, 0.3, 0.1, 0.25, 0.2, 0.1]
    n = 20000
    out = sample(logits_from_probs(probs, n), build([P(top_k=3) for _ in range(n)], 6))
    expected = torch.tensor([0, 0.3, 0, 0.25, 0.2, 0]) / 0.75
    assert chi_square(out.token_ids, expected) < 20.0  # df=2: p~5e-5


@pytest.mark.parametrize("seeded", [False, True])
def test_top_p_keeps_exactly_the_nucleus(seeded):
    torch.manual_seed(6)
    # sorted: 0.4 (t2), 0.3 (t0), 0.15 (t4), 0.1 (t1), 0.05 (t3); cumulative 0.4, 0.7, 0.85 >= 0.8
    probs = [0.3, 0.1, 0.4, 0.05, 0.15]
    n = 20000
    params = [P(top_p=0.8, seed=(1000 + i if seeded else None)) for i in range(n)]
    out = sample(logits_from_probs(probs, n), build(params, 5))
    expected = torch.tensor([0.3, 0, 0.4, 0, 0.15]) / 0.85
    stat = chi_square(out.token_ids, expected)  # also asserts nothing outside the nucleus
    assert stat < 20.0
    assert torch.allclose(frequencies(out.token_ids, 5), expected.double(), atol=0.015)


def test_top_p_always_keeps_one_token():
    probs = [0.1, 0.6, 0.3]
    out = sample(logits_from_probs(probs, 50), build([P(top_p=1e-6) for _ in range(50)], 3))
    assert (out.token_ids == 1).all()


def test_top_p_with_temperature_uses_tempered_distribution():
    torch.manual_seed(7)
    # at T=0.5 probs ~ p^2 (normalised), so the nucleus for p=0.8 is {0, 1}, while at T=1 it is {0, 1, 2}
    probs = torch.tensor([0.6, 0.5, 0.3, 0.1])
    tempered = probs ** 2 / (probs ** 2).sum()  # 0.507, 0.352, 0.127, 0.014 -> cum .507 .859
    n = 20000
    out = sample(logits_from_probs(probs.tolist(), n),
                 build([P(temperature=0.5, top_p=0.8) for _ in range(n)], 4))
    expected = torch.tensor([tempered[0], tempered[1], 0, 0])
    expected = expected / expected.sum()
    assert chi_square(out.token_ids, expected) < 20.0


def test_min_p():
    torch.manual_seed(8)
    probs = [0.5, 0.3, 0.1, 0.06, 0.04]  # min_p 0.15 -> threshold 0.075: keep {0, 1, 2}
    n = 20000
    out = sample(logits_from_probs(probs, n), build([P(min_p=0.15) for _ in range(n)], 5))
    expected = torch.tensor([0.5, 0.3, 0.1, 0, 0]) / 0.9
    assert chi_square(out.token_ids, expected) < 20.0


def test_unconstrained_matches_softmax():
    torch.manual_seed(9)
    probs = torch.tensor([0.05, 0.15, 0.3, 0.5])
    n = 20000
    for seeded in (False, True):
        params = [P(seed=(i * 7919 if seeded else None)) for i in range(n)]
        out = sample(logits_from_probs(probs.tolist(), n), build(params, 4))
        assert chi_square(out.token_ids, probs) < 22.0  # df=3


def test_per_row_params_in_one_batch():
    torch.manual_seed(10)
    probs = [0.4, 0.3, 0.2, 0.1]
    n = 4000
    params = [P(top_k=1) for _ in range(n)] + [P(top_k=2) for _ in range(n)] + [P() for _ in range(n)]
    out = sample(logits_from_probs(probs, 3 * n), build(params, 4))
    assert (out.token_ids[:n] == 0).all()
    assert set(out.token_ids[n:2 * n].unique().tolist()) == {0, 1}
    assert set(out.token_ids[2 * n:].unique().tolist()) == {0, 1, 2, 3}


# --------------------------------------------------------------------------- penalties

BASE = [2.0, -1.0, 0.5, 3.0, -2.0]
PROMPT = [0, 1]
OUTPUT = [1, 3, 3]


@pytest.mark.parametrize("kw,expected", [
    (dict(repetition_penalty=2.0), [1.0, -2.0, 0.5, 1.5, -2.0]),         # seen: {0, 1, 3}
    (dict(frequency_penalty=0.5), [2.0, -1.5, 0.5, 2.0, -2.0]),          # counts {1: 1, 3: 2}
    (dict(presence_penalty=0.25), [2.0, -1.25, 0.5, 2.75, -2.0]),
    (dict(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
     [1.0, -2.75, 0.5, 0.25, -2.0]),
    (dict(frequency_penalty=-1.0), [2.0, 0.0, 0.5, 5.0, -2.0]),
])
def test_penalties_hand_computed(kw, expected):
    t = build([P(**kw)], 5, prompts=[PROMPT], outputs=[OUTPUT])
    assert t.any_penalties
    logits = torch.tensor([BASE], device=DEV)
    got = apply_penalties(logits, t)
    assert torch.allclose(got.cpu(), torch.tensor([expected]), atol=1e-6)
    assert torch.equal(logits, torch.tensor([BASE], device=DEV))  # input untouched


def test_penalties_per_row_and_padding():
    # rows with different prompt/output lengths (padding must not penalise anything)
    params = [P(repetition_penalty=2.0), P(), P(frequency_penalty=1.0)]
    t = build(params, 5, prompts=[[0], [0, 1, 2, 3, 4], []], outputs=[[], [4], [2, 2, 2, 2]])
    logits = torch.tensor([BASE] * 3, device=DEV)
    got = apply_penalties(logits, t).cpu()
    assert torch.allclose(got[0], torch.tensor([1.0, -1.0, 0.5, 3.0, -2.0]))
    assert torch.allclose(got[1], torch.tensor(BASE))
    assert torch.allclose(got[2], torch.tensor([2.0, -1.0, -3.5, 3.0, -2.0]))


def test_penalties_change_greedy_choice():
    t = build([P(temperature=0.0, repetition_penalty=4.0)], 5, prompts=[[3]], outputs=[[]])
    out = sample(torch.tensor([BASE], device=DEV), t)
    assert out.token_ids.item() == 0  # 3.0 / 4 = 0.75 < 2.0


# --------------------------------------------------------------------------- seeds

def _flat_logits(n, v=64):
    return torch.zeros(n, v, device=DEV)


def test_seeded_same_alone_or_batched_and_repeated():
    torch.manual_seed(11)
    v = 64
    logits_row = torch.randn(1, v, device=DEV) * 0.5
    me = P(seed=1234, temperature=0.9, top_p=0.95)
    alone = sample(logits_row, build([me], v, outputs=[[1, 2, 3]])).token_ids
    others = [P(seed=7), P(), P(temperature=0.0), P(top_k=5)]
    for pos in range(5):
        params = others[:pos] + [me] + others[pos:]
        outs = [[9] * (j + 1) for j in range(5)]
        outs[pos] = [1, 2, 3]  # same number of output tokens -> same draw
        logits = torch.randn(5, v, device=DEV)
        logits[pos] = logits_row[0]
        got = sample(logits, build(params, v, outputs=outs)).token_ids[pos]
        assert got == alone[0]
    # repeated calls, different global RNG state
    for s in range(3):
        torch.manual_seed(100 + s)
        assert torch.equal(sample(logits_row, build([me], v, outputs=[[1, 2, 3]])).token_ids, alone)


def test_seeded_sequence_reproducible_and_seeds_differ():
    v = 64

    def run(seed, steps=30):
        out = []
        for _ in range(steps):
            tok = sample(_flat_logits(1, v), build([P(seed=seed)], v, outputs=[list(out)])).token_ids
            out.append(int(tok[0]))
        return out

    a, b, c = run(1), run(1), run(2)
    assert a == b
    assert a != c
    assert len(set(a)) > 10  # the draw depends on the step (output count)


def test_seeded_uniform_properties():
    seeds = torch.tensor([0, 1, -5, 2 ** 62], dtype=torch.int64, device=DEV)
    counts = torch.tensor([0, 0, 3, 100], dtype=torch.int64, device=DEV)
    u = seeded_uniform(seeds, counts, 4096)
    assert u.dtype == torch.float32 and u.shape == (4, 4096)
    assert (u > 0).all() and (u < 1).all()
    assert abs(float(u.mean()) - 0.5) < 0.01
    assert torch.equal(u, seeded_uniform(seeds, counts, 4096))
    # prefix-stable in vocab size and independent of the other rows
    assert torch.equal(seeded_uniform(seeds[2:3], counts[2:3], 100), u[2:3, :100])
    # golden values: the hash must be bit-identical on every device and platform
    g = seeded_uniform(torch.tensor([42], device=DEV), torch.tensor([7], device=DEV), 3)
    assert torch.equal(g.cpu(), GOLDEN_42_7)


# (2k + 1) numerators of seeded_uniform(seed=42, count=7) for token ids 0, 1, 2
GOLDEN_42_7 = torch.tensor([[4099923.0, 12143061.0, 10058937.0]]) * 2.0 ** -24


def test_large_python_seeds_accepted():
    t = build([P(seed=2 ** 64 + 5), P(seed=-3), P(seed=5)], 16)
    assert t.seeds[0] == t.seeds[2]
    assert t.any_seeded and t.all_seeded


# --------------------------------------------------------------------------- logprobs

def test_logprobs_match_penalised_log_softmax():
    torch.manual_seed(12)
    v = 40
    logits = torch.randn(4, v, device=DEV)
    params = [P(temperature=0.0, logprobs=3, repetition_penalty=1.5),
              P(temperature=0.8, logprobs=5, frequency_penalty=0.3),
              P(temperature=1.0, logprobs=0, top_k=4),
              P(temperature=0.0, logprobs=None)]
    t = build(params, v, prompts=[[1, 2], [3], [4], []], outputs=[[5], [6, 6], [], [7]])
    assert t.num_logprobs == 5 and t.want_logprobs
    out = sample(logits, t)
    ref = torch.log_softmax(apply_penalties(logits, t), dim=-1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.logprobs.dtype == torch.float32
    assert out.top_logprobs.shape == (4, 5) and out.top_token_ids.shape == (4, 5)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    assert torch.allclose(out.top_logprobs, ref.gather(1, out.top_token_ids))
    for r in (0, 3):  # greedy rows: the sampled token is the argmax, first in top-k
        assert out.top_token_ids[r, 0] == out.token_ids[r]
        assert out.top_logprobs[r, 0] == out.logprobs[r]


def test_logprobs_zero_gives_sampled_logprob_only():
    t = build([P(logprobs=0)], 10)
    assert t.num_logprobs == 0 and t.want_logprobs
    out = sample(torch.randn(1, 10, device=DEV), t)
    assert out.logprobs is not None and out.top_logprobs is None


# --------------------------------------------------------------------------- off values and flags

def test_build_off_values_and_flags():
    t = build([P(top_k=-1), P(top_k=0), P(top_k=10), P(top_k=50)], 10)
    assert t.top_k.tolist() == [10, 10, 10, 10]
    assert not (t.any_top_k or t.any_top_p or t.any_min_p or t.any_penalties or t.any_seeded)
    assert not t.all_greedy and t.num_logprobs == 0 and not t.want_logprobs
    assert t.prompt_mask is None and t.output_counts is None
    # flags ignore greedy rows
    t = build([P(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1, seed=1)], 10)
    assert t.all_greedy and not (t.any_top_k or t.any_top_p or t.any_min_p or t.any_seeded)


def test_empty_batch():
    t = build([], 10)
    out = sample(torch.empty(0, 10, device=DEV), t)
    assert out.token_ids.shape == (0,)


# --------------------------------------------------------------------------- no host sync

def test_no_host_sync_calls_in_module_source():
    src = inspect.getsource(S)
    for bad in (".item(", ".tolist(", ".cpu(", ".nonzero(", "torch.nonzero", ".numpy(",
                "torch.multinomial", "synchronize("):
        assert bad not in src, bad


@pytest.mark.gpu
def test_no_sync_under_cuda_sync_debug_mode():
    v = 1000
    params = [P(temperature=0.0, logprobs=2), P(top_k=5, seed=3), P(top_p=0.9, min_p=0.05),
              P(repetition_penalty=1.2, presence_penalty=0.1, frequency_penalty=0.2, logprobs=4),
              P(logit_bias={3: 5.0}, allowed_token_ids=[3, 4, 5], min_tokens=1, stop_token_ids=[4]),
              RequestSampling(bad_words=((3,), (8, 9, 5)))]
    t = SamplingTensors.build(params, [[1, 2], [3], [], [5], [], []], [[7], [], [8, 9], [1], [], [8, 9]], v, "cuda")
    logits = torch.randn(6, v, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
