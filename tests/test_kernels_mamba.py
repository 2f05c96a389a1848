"""Mamba-2 kernels (causal conv1d varlen/update, SSD varlen scan, selective state update, gated
RMSNorm): Triton kernels and their torch references against a float64 evaluation of the
reference, on fresh random ragged batches, with outputs and state pages poisoned (NaN) so that
unwritten elements fail and pages that must not be written are checked to be untouched. The
float64 references are themselves checked against naive token-by-token recurrences, the varlen
kernels against their decode kernels step by step, and all of them against transformers' torch
functions. Kernels run under TRITON_INTERPRET=1 without a GPU (tests/conftest.py): small shapes."""
from __future__ import annotations

import inspect
import math
import random

import pytest
import torch
import torch.nn.functional as F

from kernels.gated_rmsnorm import gated_rms_norm, gated_rms_norm_ref
from kernels.mamba_conv import (causal_conv1d_update, causal_conv1d_update_ref, causal_conv1d_varlen,
                                causal_conv1d_varlen_ref)
from kernels.mamba_ssd import SSD_MAX_CHUNK, ssd_scan_varlen, ssd_scan_varlen_ref
from kernels.mamba_state_update import selective_state_update, selective_state_update_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# ||out - ref|| / ||ref|| bound per operand dtype (a few ulps of the output dtype)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# the SSD scan multiplies in the activation dtype (decay-weighted C B^T, states entering a chunk)
SSD_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 5e-5}
# states stored in this dtype: one rounding
STATE_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output (unwritten or poisoned elements)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, tol: dict = TOL) -> None:
    assert out.shape == ref.shape and out.dtype == dtype, (out.shape, ref.shape, out.dtype, dtype)
    err = rel_err(out, ref)
    assert err < tol[dtype], err


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE, dtype=torch.float32) * scale).to(dtype)


def i32(v) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int32, device=DEVICE)


# ----------------------------------------------------------------------------- ragged batches

class Batch:
    """A ragged batch with its chunk partition and page assignment (all int32, on DEVICE).

    Chunks: random lengths in 1..max_chunk (some exactly max_chunk), a chunk end at every
    sequence end. Pages: every chunk gets a distinct page, then some are set to 0 or -1 (not
    written); the last chunk of a sequence mostly keeps its page (the final state). Initial
    pages cycle through: 0 (zeros), a fresh page, the sequence's own last write page (in-place
    update), its first write page, -1 (zeros); a sequence with no tokens gets a fresh page."""

    def __init__(self, lens: list[int], seed: int, max_chunk: int = SSD_MAX_CHUNK, skip_frac: float = 0.3):
        rng = random.Random(seed)
        self.lens, S = lens, len(lens)
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        starts, seqs = [], []
        for s, n in enumerate(lens):
            t = qsl[s]
            while t < qsl[s + 1]:
                starts.append(t)
                seqs.append(s)
                t += min(qsl[s + 1] - t, rng.choice([max_chunk, rng.randint(1, max_chunk), rng.randint(1, 5)]))
        NC = len(seqs)
        self.num_pages = NC + S + 3
        perm = list(range(1, self.num_pages))
        rng.shuffle(perm)
        pages = perm[:NC]
        last_of = {s: c for c, s in enumerate(seqs)}
        first_of = {}
        for c, s in enumerate(seqs):
            first_of.setdefault(s, c)
        for c in range(NC):
            if c != last_of[seqs[c]] and rng.random() < skip_frac:
                pages[c] = rng.choice([0, -1])
        fresh = iter(perm[NC:])
        init = []
        for s in range(S):
            kind = s % 5
            if s not in last_of:  # no tokens: a page that must stay untouched
                init.append(next(fresh))
            elif kind == 0:
                init.append(0)
            elif kind == 1:
                init.append(next(fresh))
            elif kind == 2:  # in place: the final state overwrites the initial one
                init.append(pages[last_of[s]])
            elif kind == 3:  # the first checkpoint overwrites the initial state
                if pages[first_of[s]] <= 0:
                    pages[first_of[s]] = next(fresh)
                init.append(pages[first_of[s]])
            else:
                init.append(-1)
        self.S, self.NC, self.T = S, NC, qsl[-1]
        self.qsl, self.init = i32(qsl), i32(init)
        self.chunk_start, self.chunk_seq, self.chunk_page = i32(starts + [qsl[-1]]), i32(seqs), i32(pages)
        self.written = sorted(p for p in pages if p > 0)
        self.read = sorted(p for p in init if p > 0)
        assert len(set(self.written)) == len(self.written)

    def args(self) -> tuple:
        return self.qsl, self.init, self.chunk_start, self.chunk_seq, self.chunk_page


def state_pool(batch: Batch, page_shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): a layer's strided view `[num_pages, *page_shape]` of a buffer holding two
    layers, NaN everywhere except random initial states in the pages that are read."""
    buf = torch.full((batch.num_pages, 2, *page_shape), float("nan"), device=DEVICE, dtype=dtype)
    view = buf[:, 1]
    assert not view.is_contiguous()
    for p in batch.read:
        view[p] = randn(*page_shape, dtype=dtype)
    return buf, view


def check_pages(view: torch.Tensor, before: torch.Tensor, expect: torch.Tensor, written: list[int],
                tol: float, buf: torch.Tensor) -> None:
    """Written pages hold `expect`; every other page is bitwise unchanged (NaN stays NaN); the
    other layer's half of the buffer is untouched."""
    for p in range(view.shape[0]):
        if p in written:
            err = rel_err(view[p], expect[p])
            assert err < tol, (p, err)
        else:
            assert torch.equal(view[p].isnan(), before[p].isnan()), f"page {p} was written"
            assert torch.equal(view[p].nan_to_num(), before[p].nan_to_num()), f"page {p} was written"
    assert buf[:, 0].isnan().all(), "wrote outside the layer's view"


# ----------------------------------------------------------------------------- naive oracles

def naive_conv(x, weight, bias, init, activation):
    """One sequence, token by token: x [L, D], init [K-1, D] -> out [L, D], states [L, K-1, D]
    (the state after each token)."""
    K = weight.shape[1]
    win = init.clone()
    outs, states = [], []
    for t in range(x.shape[0]):
        full = torch.cat([win, x[t:t + 1]])
        y = (full.T * weight).sum(1) + (bias if bias is not None else 0)
        outs.append(F.silu(y) if activation else y)
        win = full[1:]
        states.append(win.clone())
    return torch.stack(outs), torch.stack(states) if states else init.new_zeros(0, K - 1, x.shape[1])


def naive_scan(x, dt, A, B, C, D, h0):
    """One sequence, token by token, dt already discretised: x [L,H,P], dt [L,H], B/C [L,H,N]
    (heads expanded), h0 [H,P,N] -> out [L,H,P], states [L,H,P,N]."""
    h = h0.clone()
    outs, states = [], []
    for t in range(x.shape[0]):
        h = torch.exp(dt[t] * A)[:, None, None] * h + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :]
        y = torch.einsum("hpn,hn->hp", h, C[t])
        if D is not None:
            y = y + D[:, None] * x[t]
        outs.append(y)
        states.append(h.clone())
    return torch.stack(outs), torch.stack(states)


def disc_dt(dt, dt_bias, softplus, limit):
    d = dt + (dt_bias if dt_bias is not None else 0)
    if softplus:
        d = F.softplus(d)
    return d.clamp(limit[0], limit[1])


# ----------------------------------------------------------------------------- causal conv1d

CONV_LENS = [[1, 70, 5, 2, 130, 1], [3, 1, 0, 1, 66]]


def conv_inputs(batch: Batch, D: int, K: int, dtype: torch.dtype, strided: bool, with_bias: bool):
    if strided:  # a column slice of a projection output
        proj = randn(batch.T, D + 40, dtype=dtype)
        x = proj[:, 24:24 + D]
        assert not x.is_contiguous()
    else:
        x = randn(batch.T, D, dtype=dtype)
    weight = randn(D, K, dtype=dtype, scale=0.5)
    bias = randn(D, dtype=dtype) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize("impl", [causal_conv1d_varlen, causal_conv1d_varlen_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D,K,with_bias,act,strided,lens", [(48, 4, True, "silu", True, 0), (200, 4, False, None, False, 1),
                                                           (64, 2, True, "silu", False, 0), (24, 3, False, "silu", True, 1)])
def test_conv_varlen(impl, dtype, D, K, with_bias, act, strided, lens):
    batch = Batch(CONV_LENS[lens], seed=D + K)
    x, weight, bias = conv_inputs(batch, D, K, dtype, strided, with_bias)
    buf, state = state_pool(batch, (K - 1, D), dtype)
    before = state.clone()
    expect = before.double()
    ref = causal_conv1d_varlen_ref(x.double(), weight.double(), None if bias is None else bias.double(), expect,
                                   *batch.args(), activation=act)
    out = torch.full((batch.T, D), float("nan"), device=DEVICE, dtype=dtype)
    x_in = x.clone()
    got = impl(x, weight, bias, state, *batch.args(), activation=act, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(x, x_in), "input modified"
    check(out, ref, dtype)
    check_pages(state, before, expect, batch.written, 1e-12, buf)  # states are copies of inputs: exact


@pytest.mark.parametrize("impl", [causal_conv1d_update, causal_conv1d_update_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D,K,with_bias,act", [(48, 4, True, "silu"), (200, 4, False, None), (24, 2, True, "silu")])
def test_conv_update(impl, dtype, D, K, with_bias, act):
    S, num_pages = 6, 12
    x = randn(S, D + 16, dtype=dtype)[:, 8:8 + D]  # strided rows
    weight = randn(D, K, dtype=dtype, scale=0.5)
    bias = randn(D, dtype=dtype) if with_bias else None
    init = i32([3, 0, 5, -1, 9, 7])
    write = i32([3, 4, 0, 1, 10, -1])  # in place, fresh page, skipped (0, -1)
    buf = torch.full((num_pages, 2, K - 1, D), float("nan"), device=DEVICE, dtype=dtype)
    state = buf[:, 1]
    for p in (3, 5, 9, 7):
        state[p] = randn(K - 1, D, dtype=dtype)
    before = state.clone()
    expect = before.double()
    ref = causal_conv1d_update_ref(x.double(), weight.double(), None if bias is None else bias.double(), expect,
                                   init, write, activation=act)
    out = torch.full((S, D), float("nan"), device=DEVICE, dtype=dtype)
    impl(x, weight, bias, state, init, write, activation=act, out=out)
    check(out, ref, dtype)
    check_pages(state, before, expect, [3, 4, 1, 10], 1e-12, buf)


def test_conv_ref_equals_naive():
    """The float64 reference against the token-by-token oracle, including every checkpoint."""
    batch = Batch([1, 70, 5, 2, 130, 3], seed=3)
    D, K = 16, 4
    x, weight, bias = conv_inputs(batch, D, K, torch.float64, True, True)
    _, state = state_pool(batch, (K - 1, D), torch.float64)
    before = state.clone()
    out = causal_conv1d_varlen_ref(x, weight, bias, state, *batch.args(), activation="silu")
    qsl = batch.qsl.tolist()
    for s in range(batch.S):
        p = int(batch.init[s])
        init = before[p] if p > 0 else torch.zeros(K - 1, D, dtype=torch.float64, device=DEVICE)
        o, states = naive_conv(x[qsl[s]:qsl[s + 1]], weight, bias, init, "silu")
        torch.testing.assert_close(out[qsl[s]:qsl[s + 1]], o, rtol=1e-12, atol=1e-12)
        for c in range(batch.NC):
            if int(batch.chunk_seq[c]) == s and int(batch.chunk_page[c]) > 0:
                end = int(batch.chunk_start[c + 1]) - qsl[s]
                torch.testing.assert_close(state[int(batch.chunk_page[c])], states[end - 1], rtol=0, atol=0)


# ----------------------------------------------------------------------------- SSD scan

# H, P, G, N, has_D, has_dt_bias, softplus, dt_limit, state dtype ("x": the activation dtype), strided
SSD_CASES = {
    "G1-D-bias-strided": (4, 16, 1, 16, True, True, True, (0.0, math.inf), torch.float32, True),
    "G2-noD-x-state": (4, 16, 2, 16, False, True, True, (0.0, math.inf), "x", True),
    "G4-nobias-nosoftplus": (4, 8, 4, 24, True, False, False, (0.0, math.inf), torch.float32, False),
    "limit-P24": (2, 24, 1, 16, True, True, True, (0.2, 0.6), torch.float32, True),
}
SSD_LENS = [1, 70, 0, 5, 1, 130, 2, 64]


def ssd_inputs(T: int, H: int, P: int, G: int, N: int, dtype: torch.dtype, has_D: bool, has_bias: bool,
               softplus: bool, strided: bool):
    if strided:  # views of one projection output [T, H*P + 2*G*N + H + pad], as the mixer splits it
        proj = randn(T, H * P + 2 * G * N + H + 8, dtype=dtype)
        x = proj[:, :H * P].view(T, H, P)
        B = proj[:, H * P:H * P + G * N].view(T, G, N)
        C = proj[:, H * P + G * N:H * P + 2 * G * N].view(T, G, N)
        dt = proj[:, H * P + 2 * G * N:H * P + 2 * G * N + H]
        assert not x.is_contiguous() and not dt.is_contiguous()
    else:
        x, B, C, dt = randn(T, H, P, dtype=dtype), randn(T, G, N, dtype=dtype), randn(T, G, N, dtype=dtype), None
    if not softplus:  # raw dt must already be a (small, positive) step
        dt_new = (torch.rand(T, H, device=DEVICE) * 0.5).to(dtype)
        dt = dt_new if dt is None else dt.copy_(dt_new)
    elif dt is None:
        dt = randn(T, H, dtype=dtype, scale=0.5)
    A = -(torch.rand(H, device=DEVICE) * 1.5 + 0.05)  # fp32, negative
    D = randn(H, dtype=torch.float32) if has_D else None
    dt_bias = randn(H, dtype=torch.float32, scale=0.5) if has_bias else None
    return x, dt, A, B, C, D, dt_bias


def dbl(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("impl", [ssd_scan_varlen, ssd_scan_varlen_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(SSD_CASES))
def test_ssd_varlen(impl, dtype, case):
    H, P, G, N, has_D, has_bias, softplus, limit, sdt, strided = SSD_CASES[case]
    sdt = dtype if sdt == "x" else sdt
    batch = Batch(SSD_LENS, seed=H * P + N + G)
    x, dt, A, B, C, D, dt_bias = ssd_inputs(batch.T, H, P, G, N, dtype, has_D, has_bias, softplus, strided)
    buf, state = state_pool(batch, (H, P, N), sdt)
    before = state.clone()
    expect = before.double()
    ref = ssd_scan_varlen_ref(x.double(), dt.double(), A.double(), B.double(), C.double(), dbl(D), dbl(dt_bias),
                              softplus, limit, expect, *batch.args())
    out = torch.full((batch.T, H, P), float("nan"), device=DEVICE, dtype=dtype)
    got = impl(x, dt, A, B, C, D, dt_bias, softplus, limit, state, *batch.args(), out=out)
    assert got.data_ptr() == out.data_ptr()
    check(out, ref, dtype, SSD_TOL)
    check_pages(state, before, expect, batch.written, max(SSD_TOL[dtype], STATE_TOL[sdt]), buf)


@pytest.mark.parametrize("case", list(SSD_CASES))
def test_ssd_ref_equals_naive(case):
    """The float64 reference against the token-by-token recurrence, outputs and every checkpoint."""
    H, P, G, N, has_D, has_bias, softplus, limit, _, strided = SSD_CASES[case]
    batch = Batch(SSD_LENS, seed=7)
    x, dt, A, B, C, D, dt_bias = ssd_inputs(batch.T, H, P, G, N, torch.float64, has_D, has_bias, softplus, strided)
    A = A.double()
    D, dt_bias = dbl(D), dbl(dt_bias)
    _, state = state_pool(batch, (H, P, N), torch.float64)
    before = state.clone()
    out = ssd_scan_varlen_ref(x, dt, A, B, C, D, dt_bias, softplus, limit, state, *batch.args())
    qsl = batch.qsl.tolist()
    d = disc_dt(dt, dt_bias, softplus, limit)
    Bh, Ch = B.repeat_interleave(H // G, 1), C.repeat_interleave(H // G, 1)
    for s in range(batch.S):
        a, b = qsl[s], qsl[s + 1]
        if a == b:
            continue
        p = int(batch.init[s])
        h0 = before[p] if p > 0 else torch.zeros(H, P, N, dtype=torch.float64, device=DEVICE)
        o, states = naive_scan(x[a:b], d[a:b], A, Bh[a:b], Ch[a:b], D, h0)
        torch.testing.assert_close(out[a:b], o, rtol=1e-10, atol=1e-10)
        for c in range(batch.NC):
            if int(batch.chunk_seq[c]) == s and int(batch.chunk_page[c]) > 0:
                end = int(batch.chunk_start[c + 1]) - a
                torch.testing.assert_close(state[int(batch.chunk_page[c])], states[end - 1], rtol=1e-10, atol=1e-10)


def test_ssd_empty_sequences_and_single_tokens():
    """Sequences with no tokens do nothing (their init page is not touched); a batch of 1-token
    sequences (each its own chunk) matches the decode kernel."""
    H, P, G, N = 2, 16, 1, 16
    lens = [0, 1, 0, 1, 1, 0]
    qsl = [0, 0, 1, 1, 2, 3, 3]
    x, dt, A, B, C, D, dt_bias = ssd_inputs(3, H, P, G, N, torch.float32, True, True, True, False)
    state = torch.full((10, H, P, N), float("nan"), device=DEVICE)
    for p in (1, 2, 3, 4):
        state[p] = randn(H, P, N, dtype=torch.float32)
    init, cpage = i32([1, 2, 3, 0, 4, 5]), i32([6, 7, 8])
    before = state.clone()
    out = ssd_scan_varlen(x, dt, A, B, C, D, dt_bias, True, (0.0, math.inf), state, i32(qsl), init,
                          i32([0, 1, 2, 3]), i32([1, 3, 4]), cpage)
    dec_state = before.clone()
    dec = selective_state_update(x, dt, A, B, C, D, dt_bias, True, (0.0, math.inf), dec_state, i32([2, 0, 4]),
                                 i32([6, 7, 8]))
    torch.testing.assert_close(out, dec, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[6:9], dec_state[6:9], rtol=1e-5, atol=1e-5)
    assert torch.equal(state[:6].nan_to_num(), before[:6].nan_to_num()) and state[[0, 5, 9]].isnan().all()
    assert lens == [qsl[i + 1] - qsl[i] for i in range(6)]


# ----------------------------------------------------------------------------- selective state update

@pytest.mark.parametrize("impl", [selective_state_update, selective_state_update_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case,with_z", [("G1-D-bias-strided", True), ("G2-noD-x-state", False),
                                         ("G4-nobias-nosoftplus", True), ("limit-P24", False)])
def test_state_update(impl, dtype, case, with_z):
    H, P, G, N, has_D, has_bias, softplus, limit, sdt, strided = SSD_CASES[case]
    sdt = dtype if sdt == "x" else sdt
    S, num_pages = 6, 12
    x, dt, A, B, C, D, dt_bias = ssd_inputs(S, H, P, G, N, dtype, has_D, has_bias, softplus, strided)
    z = randn(S, H, P, dtype=dtype) if with_z else None
    init = i32([3, 0, 5, -1, 9, 7])
    write = i32([3, 4, 0, 1, 10, -1])  # in place, fresh page, skipped (0, -1)
    buf = torch.full((num_pages, 2, H, P, N), float("nan"), device=DEVICE, dtype=sdt)
    state = buf[:, 1]
    for p in (3, 5, 9, 7):
        state[p] = randn(H, P, N, dtype=sdt)
    before = state.clone()
    expect = before.double()
    ref = selective_state_update_ref(x.double(), dt.double(), A.double(), B.double(), C.double(), dbl(D),
                                     dbl(dt_bias), softplus, limit, expect, init, write, z=dbl(z))
    out = torch.full((S, H, P), float("nan"), device=DEVICE, dtype=dtype)
    impl(x, dt, A, B, C, D, dt_bias, softplus, limit, state, init, write, z=z, out=out)
    check(out, ref, dtype)
    check_pages(state, before, expect, [3, 4, 1, 10], max(TOL[dtype], STATE_TOL[sdt]), buf)


# ----------------------------------------------------------------------------- varlen == decode steps

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen_equals_decode_steps(dtype):
    """Independent of the references: the varlen conv and scan over two sequences (random chunks,
    checkpoints) equal the decode kernels run token by token in place on one page, outputs,
    checkpoints and final states. In bf16 the scan rounds its dot operands: a looser bound."""
    H, P, G, N, D_, K = 4, 16, 2, 16, 40, 4
    batch = Batch([45, 3, 80], seed=11, skip_frac=0.0)
    T = batch.T
    xc, w, bias = conv_inputs(batch, D_, K, dtype, True, True)
    x, dt, A, B, C, D, dt_bias = ssd_inputs(T, H, P, G, N, dtype, True, True, True, True)
    limit = (0.0, math.inf)
    cbuf, cstate = state_pool(batch, (K - 1, D_), dtype)
    sbuf, sstate = state_pool(batch, (H, P, N), torch.float32)
    cbefore, sbefore = cstate.clone(), sstate.clone()
    conv_out = causal_conv1d_varlen(xc, w, bias, cstate, *batch.args())
    ssd_out = ssd_scan_varlen(x, dt, A, B, C, D, dt_bias, True, limit, sstate, *batch.args())
    qsl = batch.qsl.tolist()
    pool_c = cbefore[:2].clone()  # page 1: the running state, page 0 unused
    pool_s = sbefore[:2].clone()
    one = i32([1])
    ends = {int(batch.chunk_start[c + 1]) - 1: int(batch.chunk_page[c]) for c in range(batch.NC)}
    conv_dec, ssd_dec, ckpt = [], [], []
    for s in range(batch.S):
        p = int(batch.init[s])
        pool_c[1] = cbefore[p] if p > 0 else 0
        pool_s[1] = sbefore[p] if p > 0 else 0
        for t in range(qsl[s], qsl[s + 1]):
            conv_dec.append(causal_conv1d_update(xc[t:t + 1], w, bias, pool_c, one, one))
            ssd_dec.append(selective_state_update(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], D, dt_bias,
                                                  True, limit, pool_s, one, one))
            if ends.get(t, 0) > 0:  # a checkpoint or the final state
                assert torch.equal(cstate[ends[t]], pool_c[1]), "conv state"
                ckpt.append((sstate[ends[t]], pool_s[1].clone()))
    assert len(ckpt) == len(batch.written)
    assert cbuf[:, 0].isnan().all() and sbuf[:, 0].isnan().all(), "wrote outside the layer's view"
    conv_tol, ssd_tol = (1e-6, 5e-5) if dtype == torch.float32 else (4e-3, 2e-2)
    assert rel_err(conv_out, torch.cat(conv_dec)) < conv_tol
    assert rel_err(ssd_out, torch.cat(ssd_dec)) < ssd_tol
    for got, want in ckpt:
        assert rel_err(got, want) < ssd_tol


# ----------------------------------------------------------------------------- against transformers

def test_against_transformers_torch_functions():
    """transformers' torch mamba2_chunk_scan / causal_conv1d_fn / selective state update on one
    batch-1 sequence with an initial state, float32 and float64 inputs (HF computes in fp32)."""
    from transformers.models.bamba.modeling_bamba import (causal_conv1d_fn, mamba2_chunk_scan,
                                                          mamba2_selective_state_update)
    for dtype in (torch.float32, torch.float64):
        H, P, G, N, L, K, Dc = 4, 16, 2, 16, 150, 4, 24
        batch = Batch([L], seed=5)
        x, dt, A, B, C, D, dt_bias = ssd_inputs(L, H, P, G, N, dtype, True, True, True, False)
        A, D, dt_bias = A.to(dtype), D.to(dtype), dt_bias.to(dtype)
        h0 = randn(H, P, N, dtype=dtype)
        limit = (0.0, 0.8)
        hf_y, hf_final = mamba2_chunk_scan(x[None], dt[None], A, B[None], C[None], chunk_size=32, D=D,
                                           dt_bias=dt_bias, initial_states=h0[None], dt_softplus=True,
                                           dt_limit=limit, return_final_states=True)
        init = i32([1])
        last = i32([0] * (batch.NC - 1) + [2])
        args = (batch.qsl, init, batch.chunk_start, batch.chunk_seq, last)
        impls = [ssd_scan_varlen_ref] + ([ssd_scan_varlen] if dtype == torch.float32 else [])
        for impl in impls:
            state = torch.full((3, H, P, N), float("nan"), device=DEVICE, dtype=dtype)
            state[1] = h0
            y = impl(x, dt, A, B, C, D, dt_bias, True, limit, state, *args)
            assert rel_err(y, hf_y[0]) < 1e-5, impl
            assert rel_err(state[2], hf_final[0]) < 1e-5, impl
        # decode step: HF's function takes the mixer's expanded shapes
        hs = h0[None].clone()
        hf_dec = mamba2_selective_state_update(hs, x[:1], dt[:1, :, None].expand(1, H, P), A[:, None, None].expand(H, P, N),
                                               B[:1], C[:1], D[:, None].expand(H, P), dt_bias=dt_bias[:, None].expand(H, P),
                                               dt_softplus=True)
        for impl in [selective_state_update_ref] + ([selective_state_update] if dtype == torch.float32 else []):
            state = torch.zeros(2, H, P, N, device=DEVICE, dtype=dtype)
            state[1] = h0
            y = impl(x[:1], dt[:1], A, B[:1], C[:1], D, dt_bias, True, (0.0, math.inf), state, init, init)
            assert rel_err(y, hf_dec) < 1e-5 and rel_err(state[1], hs[0]) < 1e-5, impl
        # conv with a zero initial state
        xc = randn(L, Dc, dtype=dtype)
        w, b = randn(Dc, K, dtype=dtype, scale=0.5), randn(Dc, dtype=dtype)
        hf_c = causal_conv1d_fn(xc.T[None], w, b, activation="silu")[0].T
        cstate = torch.zeros(3, K - 1, Dc, device=DEVICE, dtype=dtype)
        for impl in [causal_conv1d_varlen_ref] + ([causal_conv1d_varlen] if dtype == torch.float32 else []):
            yc = impl(xc, w, b, cstate, batch.qsl, i32([0]), batch.chunk_start, batch.chunk_seq, last)
            assert rel_err(yc, hf_c) < 1e-5, impl
            assert torch.equal(cstate[2], xc[-(K - 1):])


# ----------------------------------------------------------------------------- gated RMSNorm

@pytest.mark.parametrize("impl", [gated_rms_norm, gated_rms_norm_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("I,group_size", [(256, 256), (192, 64), (200, 40), (2400, 24)])
@pytest.mark.parametrize("norm_before_gate,round_before_weight", [(False, False), (True, False), (False, True)],
                         ids=["gate-norm", "norm-gate", "gate-norm-bamba"])
def test_gated_rms_norm(impl, dtype, I, group_size, norm_before_gate, round_before_weight):
    T = 7
    x = randn(T, I + 32, dtype=dtype, scale=3)[:, 16:16 + I]  # strided rows
    z = randn(T, 2 * I, dtype=dtype, scale=2)[:, :I]
    w = (1 + 0.3 * torch.randn(I, device=DEVICE)).to(dtype)
    x_in = x.clone()
    got = impl(x, z, w, group_size, 1e-5, norm_before_gate, round_before_weight)
    ref = gated_rms_norm_ref(x.double(), z.double(), w.double(), group_size, 1e-5, norm_before_gate)
    assert torch.equal(x, x_in)
    check(got, ref, dtype)


@pytest.mark.parametrize("impl", [gated_rms_norm, gated_rms_norm_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gated_rms_norm_matches_transformers(impl, dtype):
    """Bamba (norm after the gate, rounded before the weight) and Falcon-H1 (both gate orders,
    one rounding): the reference bitwise; the kernel within one ulp, and bitwise for nearly all
    elements (fp32 sum order, exp), except under the interpreter in bf16, whose fp32 -> bf16
    conversion truncates instead of rounding to nearest."""
    import os

    from transformers.models.bamba.modeling_bamba import BambaRMSNormGated
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated
    T, I, groups = 9, 256, 4
    x, z = randn(T, I, dtype=dtype, scale=3), randn(T, I, dtype=dtype, scale=2)
    w = (1 + 0.3 * torch.randn(I, device=DEVICE)).to(dtype)
    # Before transformers 5.2x BambaRMSNormGated normalised over all channels (no group_size).
    if "group_size" in inspect.signature(BambaRMSNormGated).parameters:
        cases = [(BambaRMSNormGated(I, group_size=I // groups, eps=1e-6), False, True, I // groups)]
    else:
        cases = [(BambaRMSNormGated(I, eps=1e-6), False, True, I)]
    for nbg in (False, True):
        cases.append((FalconH1RMSNormGated(I, eps=1e-6, n_groups=groups, norm_before_gate=nbg), nbg, False,
                      I // groups))
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    truncating = os.environ.get("TRITON_INTERPRET") == "1" and dtype == torch.bfloat16 and impl is gated_rms_norm
    for mod, nbg, rbw, group_size in cases:
        mod = mod.to(DEVICE, dtype)
        with torch.no_grad():
            mod.weight.copy_(w)
            hf = mod(x, z)
        got = impl(x, z, w, group_size, 1e-6, nbg, rbw)
        name = type(mod).__name__
        assert hf.dtype == got.dtype
        n_ulp = 2.02 if truncating else 1.01  # truncation: up to one ulp per rounding
        assert ((got.float() - hf.float()).abs() <= n_ulp * ulp * hf.float().abs() + 1e-6).all(), name
        same = (got == hf).float().mean().item()
        if impl is gated_rms_norm_ref:
            assert same == 1.0, name
        elif not truncating:
            assert same > 0.97, (name, same)


# ----------------------------------------------------------------------------- benchmark inputs

def test_bench_inputs_build_and_run_on_cpu():
    """kernels.bench.mamba builds its inputs with any sizes; tiny ones run through the references."""
    from kernels.bench import mamba as bench_mamba
    inp = bench_mamba.decode_inputs(batch=2, H=4, P=16, N=16, G=1, state_dtype=torch.float32, device=DEVICE)
    selective_state_update_ref(**inp)
    inp = bench_mamba.prefill_inputs(batch=2, seq_len=70, H=4, P=16, N=16, G=1, device=DEVICE)
    out = ssd_scan_varlen_ref(**inp["ssd"])
    assert out.shape == (140, 4, 16) and torch.isfinite(out).all()
    causal_conv1d_varlen_ref(**inp["conv"])
    assert bench_mamba.hf_chunk_scan(inp["ssd"], chunk_size=32).shape == (140, 4, 16)
