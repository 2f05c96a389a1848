"""Gated DeltaNet kernels (chunked varlen prefill, decode step) and their torch references against
a float64 token-by-token recurrence written here from the definitions, on fresh random ragged
batches whose chunks come from the engine's planner (`plan_chunks`) or at random, with outputs
and state pages poisoned (NaN) so that unwritten elements fail and pages that must not be written
are checked to be untouched. Also: a prefill cut in two at a block end equals the whole one, the
prefill equals the decode step applied token by token, and the references equal transformers'
torch functions. Kernels run under TRITON_INTERPRET=1 without a GPU (tests/conftest.py): small
shapes."""
from __future__ import annotations

import inspect
import math
import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kernels.gated_delta import (GDN_MAX_CHUNK, gated_delta_update, gated_delta_update_ref, gated_delta_varlen,
                                 gated_delta_varlen_ref)
from kernels.gated_rmsnorm import GatedRMSNorm
from workers.mamba_metadata import plan_chunks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# ||out - ref|| / ||ref|| bounds. The prefill kernel rounds its dot operands to the 16-bit dtype
# (normalised q and k, the state entering a chunk, q k^T, v_new) and solves in TF32 on a GPU:
# measured ~5e-4 in fp16 under the interpreter (which solves in fp32), ~4e-3 expected in bf16 on a
# GPU (a torch emulation of the same roundings); the interpreter converts to bf16 by truncation,
# not round-to-nearest, which doubles the errors and biases them (~1.7e-2 measured).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
VARLEN_TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2.5e-2 if INTERPRETED else 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output (unwritten or poisoned elements)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def i32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32, device=DEVICE)


# ----------------------------------------------------------------------------- the oracle

def oracle_prepare(q, k, v, a, b, A_log, dt_bias):
    """float64, from the definitions: normalised q (scaled) and k expanded to the value heads,
    v, g and beta."""
    q, k, v, a, b, A_log, dt_bias = (t.double() for t in (q, k, v, a, b, A_log, dt_bias))
    K, Hv = q.shape[-1], v.shape[1]
    rep = Hv // q.shape[1]
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(K)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = -torch.exp(A_log) * torch.log1p(torch.exp(a + dt_bias))
    beta = 1 / (1 + torch.exp(-b))
    return qn.repeat_interleave(rep, 1), kn.repeat_interleave(rep, 1), v, g, beta


def naive(qn, kn, v, g, beta, S0):
    """One sequence, token by token: returns outputs [L, H, V] and the state after each token
    [L, H, K, V]."""
    S = S0.clone()
    outs, states = [], []
    for t in range(qn.shape[0]):
        S = S * torch.exp(g[t])[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", kn[t], S))
        S = S + kn[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hk,hkv->hv", qn[t], S))
        states.append(S.clone())
    return torch.stack(outs), torch.stack(states)


# ----------------------------------------------------------------------------- inputs

def make_inputs(T: int, Hk: int, Hv: int, K: int, V: int, dtype: torch.dtype, seed: int, corr: float = 0.0,
                strong_decay: bool = False):
    """q, k, v as views of one conv output [T, 2 Hk K + Hv V], b and a of one [T, 2 Hv]
    projection, as the layer splits them. `corr`: keys share a common direction per head with
    this weight (a harder triangular solve); `strong_decay`: head 0 forgets within a few tokens."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    conv = rnd(T, 2 * Hk * K + Hv * V + 8)
    if corr:
        keys = conv[:, Hk * K:2 * Hk * K].view(T, Hk, K)
        keys.mul_(1 - corr).add_(corr * 3 * rnd(1, Hk, K))
    conv = conv.to(DEVICE, dtype)
    q = conv[:, :Hk * K].view(T, Hk, K)
    k = conv[:, Hk * K:2 * Hk * K].view(T, Hk, K)
    v = conv[:, 2 * Hk * K:2 * Hk * K + Hv * V].view(T, Hv, V)
    proj = rnd(T, 2 * Hv + 4).to(DEVICE, dtype)
    b, a = proj[:, :Hv], proj[:, Hv:2 * Hv]
    A = torch.rand(Hv, generator=gen) * 1.5 + 0.02
    if strong_decay:
        A[0] = 16.0
    A_log = A.log().to(DEVICE)
    dt_bias = rnd(Hv, scale=0.5).to(DEVICE)
    assert not q.is_contiguous() and not v.is_contiguous() and not a.is_contiguous()
    return q, k, v, a, b, A_log, dt_bias


class Batch:
    """A ragged batch with its chunk partition and pages (int32, on DEVICE).

    `block_size` given: the engine's planner over (num_computed, qlens), each sequence with a
    table of distinct shuffled pages, some checkpoint entries null (0 or -1), the initial state
    read from entry (c-1)//B (so the first chunk of a step starting inside a block writes the
    page it read: in place), or a zero state (page 0 or -1) when c = 0. Otherwise: random chunk
    lengths in 1..GDN_MAX_CHUNK, a page per chunk (some null), initial pages cycling through zero,
    a fresh page, the last write page and the first write page of the sequence."""

    def __init__(self, qlens: list[int], seed: int, block_size: int | None = None,
                 computed: list[int] | None = None, null_frac: float = 0.3):
        rng = random.Random(seed)
        S = len(qlens)
        computed = computed or [0] * S
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        if block_size is not None:
            starts, seqs, entries = plan_chunks(np.array(computed), np.array(qlens), block_size, GDN_MAX_CHUNK)
            starts, seqs, entries = starts.tolist()[:-1], seqs.tolist(), entries.tolist()
        else:
            starts, seqs = [], []
            for s, n in enumerate(qlens):
                t = qsl[s]
                while t < qsl[s + 1]:
                    starts.append(t)
                    seqs.append(s)
                    t += min(qsl[s + 1] - t, rng.choice([GDN_MAX_CHUNK, rng.randint(1, GDN_MAX_CHUNK),
                                                         rng.randint(1, 5)]))
            entries = list(range(len(seqs)))  # one "entry" per chunk
        NC = len(seqs)
        last_of = {s: c for c, s in enumerate(seqs)}
        first_of = {}
        for c, s in enumerate(seqs):
            first_of.setdefault(s, c)
        if block_size:
            n_entries = [-(-(computed[s] + qlens[s]) // block_size) for s in range(S)]
            self.num_pages = 1 + sum(n_entries) + 2
        else:
            self.num_pages = 1 + NC + S + 2
        perm = list(range(1, self.num_pages))
        rng.shuffle(perm)
        pool = iter(perm)
        tables = [[next(pool) for _ in range(n_entries[s])] for s in range(S)] if block_size else None
        init = []
        for s in range(S):
            if block_size:
                c = computed[s]
                init.append(tables[s][(c - 1) // block_size] if c > 0 else rng.choice([0, -1]))
            elif s not in last_of:
                init.append(next(pool))  # no tokens: a page that must stay untouched
            else:
                init.append([0, next(pool), None, None, -1][s % 5])
        pages = []
        for c in range(NC):
            s, e = seqs[c], entries[c]
            if block_size:
                page = tables[s][e] if e >= 0 else rng.choice([0, -1])
                if c != last_of[s] and page > 0 and page != init[s] and rng.random() < null_frac:
                    page = rng.choice([0, -1])  # a null checkpoint entry
            else:
                page = next(pool) if c == last_of[s] or rng.random() >= null_frac else rng.choice([0, -1])
            pages.append(page)
        if not block_size:
            for s in range(S):
                if init[s] is None and s in last_of:
                    c = last_of[s] if s % 5 == 2 else first_of[s]  # in place: the last or the first write
                    if pages[c] <= 0:
                        pages[c] = next(pool)
                    init[s] = pages[c]
        self.S, self.NC, self.T = S, NC, qsl[-1]
        self.qsl, self.init = i32(qsl), i32(init)
        self.chunk_start, self.chunk_seq, self.chunk_page = i32(starts + [qsl[-1]]), i32(seqs), i32(pages)
        self.written = sorted(p for p in pages if p > 0)
        self.read = sorted(p for p in init if p > 0)
        assert len(set(self.written)) == len(self.written)

    def args(self) -> tuple:
        return self.qsl, self.init, self.chunk_start, self.chunk_seq, self.chunk_page


def state_pool(num_pages: int, read: list[int], Hv: int, K: int, V: int, seed: int):
    """(buffer, view): a layer's strided view `[num_pages, Hv, K, V]` of a buffer holding two
    layers, NaN everywhere except random initial states in the pages that are read."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((num_pages, 2, Hv, K, V), float("nan"), device=DEVICE)
    view = buf[:, 1]
    assert not view.is_contiguous()
    for p in read:
        view[p] = (torch.randn(Hv, K, V, generator=gen) * 0.5).to(DEVICE)
    return buf, view


def expected(batch: Batch, inputs, before: torch.Tensor):
    """The oracle's outputs [T, Hv, V] and the state each written page must hold."""
    qn, kn, v, g, beta = oracle_prepare(*inputs)
    Hv, K, V = before.shape[1:]
    out = torch.zeros(batch.T, Hv, V, dtype=torch.float64, device=DEVICE)
    pages = {}
    qsl = batch.qsl.tolist()
    for s in range(batch.S):
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        p = int(batch.init[s])
        S0 = before[p].double() if p > 0 else torch.zeros(Hv, K, V, dtype=torch.float64, device=DEVICE)
        o, states = naive(qn[a:b], kn[a:b], v[a:b], g[a:b], beta[a:b], S0)
        out[a:b] = o
        for c in range(batch.NC):
            if int(batch.chunk_seq[c]) == s and int(batch.chunk_page[c]) > 0:
                pages[int(batch.chunk_page[c])] = states[int(batch.chunk_start[c + 1]) - 1 - a]
    return out, pages


def check_pages(view: torch.Tensor, before: torch.Tensor, expect: dict, tol: float, buf: torch.Tensor) -> None:
    """Written pages hold `expect`; every other page is bitwise unchanged (NaN stays NaN); the
    other layer's half of the buffer is untouched."""
    for p in range(view.shape[0]):
        if p in expect:
            err = rel_err(view[p], expect[p])
            assert err < tol, (p, err)
        else:
            assert torch.equal(view[p].isnan(), before[p].isnan()), f"page {p} was written"
            assert torch.equal(view[p].nan_to_num(), before[p].nan_to_num()), f"page {p} was written"
    assert buf[:, 0].isnan().all(), "wrote outside the layer's view"


# ----------------------------------------------------------------------------- varlen prefill

# Hk, Hv, K, V, qlens, computed, block_size (None: random chunks), corr, strong decay, config
VARLEN_CASES = {
    # chunks of <= 16 tokens (one solve block), steps starting inside a block (in place), 1 token
    "Hv=Hk-K16V16-bs16": (2, 2, 16, 16, [1, 70, 75], [0, 20, 5], 16, 0.0, False, None),
    # whole 64-token chunks and partial ones (the block iteration of the solve), K != V, K padded
    "Hv=2Hk-K24V16-bs128": (1, 2, 24, 16, [150, 1, 0], [40, 0, 3], 128, 0.0, True, None),
    # random chunk lengths, correlated keys, V not a power of two in two column blocks
    "Hv=2Hk-K16V48-random": (2, 4, 16, 48, [1, 64, 66, 2, 17], None, None, 0.6, True,
                             {"BLOCK_V": 32, "num_warps": 4, "num_stages": 2}),
}


# fp16 runs the 16-bit products as such under the interpreter (bf16 ones are emulated in fp32
# from the rounded operands, kernels/paged_attention.py::_interpreter_bf16)
# "fused": one kernel walks each sequence's chunks; "split": the chunks' solves first, in parallel,
# then the walk (what a long prompt alone gets)
# "split-T": the split form's solves forming T at these narrow heads (on a GPU only K, V >= 64
# take it: narrower ones faulted there; the published-head test below covers it natively)
@pytest.mark.parametrize("impl", [(gated_delta_varlen, False), (gated_delta_varlen, True), (gated_delta_varlen, "T"),
                                  (gated_delta_varlen_ref, None)],
                         ids=["triton-fused", "triton-split", "triton-split-T", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen(impl, dtype, case):
    impl, split = impl
    Hk, Hv, K, V, qlens, computed, bs, corr, strong, config = VARLEN_CASES[case]
    if split == "T" and DEVICE == "cuda":
        pytest.skip("T is formed on a GPU for heads of 64 or more only")
    if split is not None:
        config = {**(config or {}), "split": split is not False, **({"prep_form_t": True} if split == "T" else {})}
    seed = len(case) + {torch.float32: 0, torch.bfloat16: 7, torch.float16: 3}[dtype]
    batch = Batch(qlens, seed, block_size=bs, computed=computed)
    inputs = make_inputs(batch.T, Hk, Hv, K, V, dtype, seed, corr, strong)
    buf, state = state_pool(batch.num_pages, batch.read, Hv, K, V, seed)
    before = state.clone()
    ref, pages = expected(batch, inputs, before)
    assert len(pages) == len(batch.written) and len(pages) > batch.S - 1
    out = torch.full((batch.T, Hv, V), float("nan"), device=DEVICE, dtype=dtype)
    kept = [t.clone() for t in inputs]
    got = impl(*inputs, state, *batch.args(), out=out, config=config)
    assert got.data_ptr() == out.data_ptr() and out.dtype == dtype
    assert all(torch.equal(t, u) for t, u in zip(inputs, kept)), "input modified"
    tol = VARLEN_TOL[dtype] if impl is gated_delta_varlen else TOL[dtype]
    err = rel_err(out, ref)
    assert err < tol, err
    # the states are fp32 whatever the inputs; their error is the computation's
    check_pages(state, before, pages, tol, buf)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_at_the_published_head_size_on_a_gpu(dtype):
    """K = V = 128 (every Qwen3-Next / Qwen3.5 checkpoint), the default launch, a ragged batch
    with a long sequence: on an H200 with Triton 3.6, bf16 launches with narrower column blocks
    than the default faulted or gave wrong outputs while the interpreter's shapes passed, so the
    kernel is checked natively at this shape, and those launches are refused."""
    Hk, Hv, K, V = 2, 4, 128, 128
    batch = Batch([700, 1, 64, 130], 5, block_size=64, computed=[0, 0, 70, 3])
    inputs = make_inputs(batch.T, Hk, Hv, K, V, dtype, 5, 0.3, True)
    buf, state = state_pool(batch.num_pages, batch.read, Hv, K, V, 5)
    before = state.clone()
    ref, pages = expected(batch, inputs, before)
    # the split form's walk at every column width (the faults were the fused kernel's) and with
    # its loads pipelined 2 deep; its solves solving for W and U rather than forming T (bf16)
    for config in ({"split": False}, {"split": True}, *({"split": True, "BLOCK_V": bv} for bv in (16, 64)),
                   {"split": True, "walk_stages": 2}, {"split": True, "prep_form_t": False}):
        state.copy_(before)
        out = torch.full((batch.T, Hv, V), float("nan"), device=DEVICE, dtype=dtype)
        gated_delta_varlen(*inputs, state, *batch.args(), out=out, config=config)
        assert rel_err(out, ref) < VARLEN_TOL[dtype], config
        check_pages(state, before, pages, VARLEN_TOL[dtype], buf)
    with pytest.raises(ValueError, match="walk_stages=1"):
        gated_delta_varlen(*inputs, state, *batch.args(), out=out, config={"split": True, "walk_stages": 1})
    if dtype != torch.float32:
        with pytest.raises(ValueError, match="BLOCK_V=32"):
            gated_delta_varlen(*inputs, state, *batch.args(), out=out,
                               config={"BLOCK_V": 32, "num_warps": 8, "num_stages": 2, "split": False})


def test_varlen_ref_float64_exact():
    """The reference in float64 against the oracle (the chunked form is the recurrence, exactly)."""
    Hk, Hv, K, V, qlens, computed, bs, corr, strong, _ = VARLEN_CASES["Hv=2Hk-K16V48-random"]
    batch = Batch(qlens, 3, block_size=bs, computed=computed)
    inputs = [t.double() for t in make_inputs(batch.T, Hk, Hv, K, V, torch.float32, 3, corr, strong)]
    _, state = state_pool(batch.num_pages, batch.read, Hv, K, V, 3)
    state = state.double()
    before = state.clone()
    ref, pages = expected(batch, inputs, before)
    out = gated_delta_varlen_ref(*inputs, state, *batch.args())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for p, want in pages.items():
        torch.testing.assert_close(state[p], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("form", ["fused", "split", "torch"])
@pytest.mark.parametrize("V", [48, 160])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_with_the_layers_gated_norm(form, V, dtype):
    """The layer's gated norm given to the prefill: its outputs through the norm as its own
    launch (or reference) computes it from the outputs without it, and the same state pages. The
    split form applies it in its output launch where one program holds a head's V columns (48),
    the norm's own launch otherwise (160), as the fused form always does."""
    Hk, Hv, K = 1, 2, 16
    impl = gated_delta_varlen_ref if form == "torch" else gated_delta_varlen
    config = None if form == "torch" else {"split": form == "split"}
    batch = Batch([70, 1, 20], seed=4, block_size=32)
    inputs = make_inputs(batch.T, Hk, Hv, K, V, dtype, 4, 0.3)
    g = torch.Generator().manual_seed(4)
    z = torch.randn(batch.T, Hv * V + 3, generator=g).to(DEVICE, dtype)[:, 3:]  # a strided view, as the layer's
    weight = (1 + 0.3 * torch.randn(Hv * V, generator=g)).to(DEVICE, dtype)
    norm = GatedRMSNorm(z, weight, V, 1e-6, norm_before_gate=True, round_before_weight=True)
    _, state = state_pool(batch.num_pages, batch.read, Hv, K, V, 4)
    pages = state.clone()
    got = impl(*inputs, pages, *batch.args(), out=torch.full((batch.T, Hv, V), float("nan"), device=DEVICE,
                                                                 dtype=dtype), config=config, norm=norm)
    plain = impl(*inputs, state, *batch.args(), config=config)
    want = norm.apply(plain.view(batch.T, Hv * V), ref=form == "torch").view(batch.T, Hv, V)
    assert torch.equal(pages.nan_to_num(), state.nan_to_num())
    tol = {torch.float32: 1e-5, torch.bfloat16: 8e-3}[dtype]  # reductions in another order: an ulp
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="groups of V"):
        impl(*inputs, state, *batch.args(), config=config,
             norm=GatedRMSNorm(z, weight, V // 2, 1e-6, norm_before_gate=True, round_before_weight=True))


@pytest.mark.parametrize("impl", [gated_delta_varlen, gated_delta_varlen_ref], ids=["triton", "torch"])
def test_varlen_cut_at_a_block_end(impl):
    """A prefill of 100 tokens equals two steps cut at the block end 64, the second reading the
    state from the first's checkpoint page: outputs and every page bitwise (the chunks are the
    same, as every block end is a chunk end)."""
    Hk, Hv, K, V, B, n, cut = 1, 2, 16, 32, 32, 100, 64
    inputs = make_inputs(n, Hk, Hv, K, V, torch.float32, 5, 0.3)
    table = [3, 7, 1, 6]  # the sequence's pages, entry by entry
    num_pages = 9

    def step(c: int, m: int, state: torch.Tensor) -> torch.Tensor:
        starts, seqs, entries = plan_chunks(np.array([c]), np.array([m]), B, GDN_MAX_CHUNK)
        pages = [table[e] if e >= 0 else 0 for e in entries.tolist()]
        init = table[(c - 1) // B] if c > 0 else 0
        sl = slice(c, c + m)
        return impl(*(t[sl] for t in inputs[:5]), *inputs[5:], state, i32([0, m]), i32([init]), i32(starts.tolist()),
                    i32(seqs.tolist()), i32(pages))

    whole = torch.full((num_pages, Hv, K, V), float("nan"), device=DEVICE)
    parts = whole.clone()
    out = step(0, n, whole)
    first = step(0, cut, parts)
    second = step(cut, n - cut, parts)
    assert torch.equal(out, torch.cat([first, second]))
    assert torch.equal(whole.nan_to_num(), parts.nan_to_num()) and torch.equal(whole.isnan(), parts.isnan())
    assert whole[table].isfinite().all() and whole[[0, 2, 4, 5, 8]].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_equals_decode_steps(dtype):
    """Independent of the references: the prefill kernel over three sequences (random chunks,
    checkpoints) equals the decode kernel run token by token in place on one page, outputs,
    checkpoints and final states. In bf16 the prefill rounds its dot operands: a looser bound."""
    Hk, Hv, K, V = 1, 2, 16, 16
    batch = Batch([45, 1, 70], seed=11, null_frac=0.0)
    inputs = make_inputs(batch.T, Hk, Hv, K, V, dtype, 11, 0.3)
    buf, state = state_pool(batch.num_pages, batch.read, Hv, K, V, 11)
    before = state.clone()
    out = gated_delta_varlen(*inputs, state, *batch.args())
    qsl = batch.qsl.tolist()
    pool = before[:2].clone()  # page 1: the running state, page 0 unused
    one = i32([1])
    ends = {int(batch.chunk_start[c + 1]) - 1: int(batch.chunk_page[c]) for c in range(batch.NC)}
    dec, ckpt = [], []
    for s in range(batch.S):
        p = int(batch.init[s])
        pool[1] = before[p] if p > 0 else 0
        for t in range(qsl[s], qsl[s + 1]):
            dec.append(gated_delta_update(*(x[t:t + 1] for x in inputs[:5]), *inputs[5:], pool, one, one))
            if ends.get(t, 0) > 0:
                ckpt.append((state[ends[t]], pool[1].clone()))
    assert len(ckpt) == len(batch.written)
    assert buf[:, 0].isnan().all()
    tol = VARLEN_TOL[dtype]
    assert rel_err(out, torch.cat(dec)) < tol
    for got, want in ckpt:
        assert rel_err(got, want) < tol


def test_varlen_empty_and_single_token_sequences():
    """Sequences with no tokens do nothing (their init page untouched); a batch of 1-token
    sequences (each its own chunk) equals the decode kernel."""
    Hk, Hv, K, V = 1, 2, 16, 16
    qsl = [0, 0, 1, 1, 2, 3, 3]
    inputs = make_inputs(3, Hk, Hv, K, V, torch.float32, 2)
    state = torch.full((10, Hv, K, V), float("nan"), device=DEVICE)
    for p in (1, 2, 3, 4):
        state[p] = torch.randn(Hv, K, V, device=DEVICE)
    before = state.clone()
    out = gated_delta_varlen(*inputs, state, i32(qsl), i32([1, 2, 3, 0, 4, 5]), i32([0, 1, 2, 3]), i32([1, 3, 4]),
                             i32([6, 7, 8]))
    dec_state = before.clone()
    dec = gated_delta_update(*inputs, dec_state, i32([2, 0, 4]), i32([6, 7, 8]))
    torch.testing.assert_close(out, dec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[6:9], dec_state[6:9], rtol=1e-5, atol=1e-5)
    assert torch.equal(state[:6].nan_to_num(), before[:6].nan_to_num()) and state[[0, 5, 9]].isnan().all()


# ----------------------------------------------------------------------------- decode step

# Hk, Hv, K, V, config
UPDATE_CASES = {
    "Hv=Hk-K16V16": (2, 2, 16, 16, None),
    "Hv=2Hk-K32V48-blocks": (1, 2, 32, 48, {"BLOCK_V": 16, "num_warps": 2}),
}
if DEVICE == "cuda":
    # the published head size, in each column block the launch rule picks (batch 1 to 128), natively
    UPDATE_CASES.update({f"Hv=2Hk-K128V128-BV{bv}": (2, 4, 128, 128, {"BLOCK_V": bv, "num_warps": nw})
                         for bv, nw in ((16, 1), (32, 2), (64, 4))})


@pytest.mark.parametrize("impl", [gated_delta_update, gated_delta_update_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(UPDATE_CASES))
def test_update(impl, dtype, case):
    Hk, Hv, K, V, config = UPDATE_CASES[case]
    S, num_pages = 6, 12
    inputs = make_inputs(S, Hk, Hv, K, V, dtype, S + K + V, 0.0, True)
    init = i32([3, 0, 5, -1, 9, 7])
    write = i32([3, 4, 0, 1, 10, -1])  # in place, fresh page, skipped (0, -1)
    buf, state = state_pool(num_pages, [3, 5, 9, 7], Hv, K, V, S)
    before = state.clone()
    qn, kn, v, g, beta = oracle_prepare(*inputs)
    ref = torch.empty(S, Hv, V, dtype=torch.float64, device=DEVICE)
    pages = {}
    for s in range(S):
        p = int(init[s])
        S0 = before[p].double() if p > 0 else torch.zeros(Hv, K, V, dtype=torch.float64, device=DEVICE)
        o, st = naive(qn[s:s + 1], kn[s:s + 1], v[s:s + 1], g[s:s + 1], beta[s:s + 1], S0)
        ref[s] = o[0]
        if int(write[s]) > 0:
            pages[int(write[s])] = st[0]
    out = torch.full((S, Hv, V), float("nan"), device=DEVICE, dtype=dtype)
    got = impl(*inputs, state, init, write, out=out, config=config)
    assert got.data_ptr() == out.data_ptr()
    err = rel_err(out, ref)
    assert err < TOL[dtype], err
    check_pages(state, before, pages, TOL[dtype], buf)


def test_update_refuses_more_sequences_than_its_grid_takes():
    """The decode launch puts sequences on the grid's third dimension (65,535 at most)."""
    S = 65536
    inputs = make_inputs(S, 1, 1, 16, 16, torch.float32, 0, 0.0, True)
    _, state = state_pool(2, [1], 1, 16, 16, 1)
    pages = torch.zeros(S, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="at most 65,535 sequences"):
        gated_delta_update(*inputs, state, pages, pages)


# ----------------------------------------------------------------------------- against transformers

def test_against_transformers_torch_functions():
    """transformers' torch_chunk_gated_delta_rule (chunks of 64 from the sequence's start, here
    the same partition) and torch_recurrent_gated_delta_rule on one sequence with an initial
    state, g and beta made as Qwen3NextGatedDeltaNet.forward makes them; fp32 inputs (transformers
    computes in fp32). The references do transformers' operations: equal to rounding; the
    kernels within 1e-5."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    # the torch functions themselves (transformers substitutes FLA's kernels where installed)
    torch_chunk_gated_delta_rule = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
    torch_recurrent_gated_delta_rule = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)
    Hk, Hv, K, V, L = 2, 4, 16, 32, 150
    q, k, v, a, b, A_log, dt_bias = make_inputs(L, Hk, Hv, K, V, torch.float32, 9, 0.3)
    h0 = torch.randn(Hv, K, V, device=DEVICE)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    # Each key head repeated for its value heads, as Qwen3NextGatedDeltaNet.forward does before
    # the call (the functions of some transformers releases take Hk < Hv, others do not).
    qv, kv = q.repeat_interleave(Hv // Hk, dim=1), k.repeat_interleave(Hv // Hk, dim=1)
    hf_o, hf_s = torch_chunk_gated_delta_rule(qv[None], kv[None], v[None], g=g[None], beta=beta[None], chunk_size=64,
                                              initial_state=h0[None], output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)
    starts = list(range(0, L, 64)) + [L]
    nc = len(starts) - 1
    args = (i32([0, L]), i32([1]), i32(starts), i32([0] * nc), i32([0] * (nc - 1) + [2]))
    for impl, tol in ((gated_delta_varlen_ref, 1e-6), (gated_delta_varlen, 1e-5)):
        state = torch.full((3, Hv, K, V), float("nan"), device=DEVICE)
        state[1] = h0
        y = impl(q, k, v, a, b, A_log, dt_bias, state, *args)
        assert rel_err(y, hf_o[0]) < tol and rel_err(state[2], hf_s[0]) < tol, impl
    # one decode step
    hf_o, hf_s = torch_recurrent_gated_delta_rule(qv[None, :1], kv[None, :1], v[None, :1], g=g[None, :1],
                                                  beta=beta[None, :1], initial_state=h0[None],
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    for impl, tol in ((gated_delta_update_ref, 1e-6), (gated_delta_update, 1e-5)):
        state = torch.full((3, Hv, K, V), float("nan"), device=DEVICE)
        state[1] = h0
        y = impl(q[:1], k[:1], v[:1], a[:1], b[:1], A_log, dt_bias, state, i32([1]), i32([2]))
        assert rel_err(y, hf_o[0]) < tol and rel_err(state[2], hf_s[0]) < tol, impl


def test_references_bitwise_transformers_in_bf16():
    """bf16 activations: the references round beta to bf16 as transformers does (b.sigmoid() in
    b's dtype) and compute the rest in fp32: the same numbers as transformers' functions given
    transformers' g and beta."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    torch_recurrent_gated_delta_rule = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)
    Hk, Hv, K, V = 1, 2, 16, 16
    q, k, v, a, b, A_log, dt_bias = make_inputs(4, Hk, Hv, K, V, torch.bfloat16, 4)
    h0 = torch.randn(Hv, K, V, device=DEVICE)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    qv, kv = q.repeat_interleave(Hv // Hk, dim=1), k.repeat_interleave(Hv // Hk, dim=1)  # as transformers' caller
    hf_o, hf_s = torch_recurrent_gated_delta_rule(qv[:, None], kv[:, None], v[:, None], g=g[:, None],
                                                  beta=b.sigmoid()[:, None], initial_state=h0[None].expand(4, -1, -1, -1),
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    state = torch.zeros(5, Hv, K, V, device=DEVICE)
    state[1:] = h0
    pages = i32([1, 2, 3, 4])
    y = gated_delta_update_ref(q, k, v, a, b, A_log, dt_bias, state, pages, pages)
    assert torch.equal(y, hf_o[:, 0]) and torch.allclose(state[1:], hf_s, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- benchmark inputs

def test_bench_inputs_build_and_run_on_cpu():
    """kernels.bench.gated_delta builds its inputs with any sizes; tiny ones run through the
    references, and its transformers comparison agrees with them."""
    from kernels.bench import gated_delta as bench
    shape = dict(Hk=1, Hv=2, K=16, V=16)
    inp = bench.decode_inputs(batch=2, **shape, device=DEVICE)
    gated_delta_update_ref(**inp)
    inp = bench.prefill_inputs(batch=2, seq_len=70, **shape, device=DEVICE, dtype=torch.float32)
    out = gated_delta_varlen_ref(**inp)
    assert out.shape == (140, 2, 16) and torch.isfinite(out).all() and inp["state"][1:].abs().sum() > 0
    assert rel_err(bench.hf_chunk(inp, 2, 70), out) < 1e-5
    assert bench.prefill_flops(64, 1, 16, 16) > 0
