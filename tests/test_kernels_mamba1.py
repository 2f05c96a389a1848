"""Mamba-1 selective scan (prefill over a ragged batch, decode step) against a float64 evaluation
of the torch reference, on fresh random ragged batches with outputs and state pages poisoned
(NaN): unwritten outputs fail, pages that must not be written are checked untouched. The float64
reference is itself checked against transformers' Jamba torch functions, and the prefill kernel
against the decode kernel run token by token. Under TRITON_INTERPRET=1 on CPU: small shapes."""
from __future__ import annotations

import pytest
import torch

from kernels.mamba1_scan import (selective_scan_update, selective_scan_update_ref, selective_scan_varlen,
                                 selective_scan_varlen_ref)
from tests.test_kernels_mamba import DEVICE, Batch, check_pages, i32, randn, rel_err, state_pool

# ||out - ref|| / ||ref||: fp32 math in both; 16-bit inputs and states round once.
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def dbl(t):
    return None if t is None else t.double()


def scan_inputs(T: int, Dm: int, N: int, dtype: torch.dtype, with_D: bool, with_bias: bool, with_z: bool):
    """x, dt, z as column slices of one projection output and B, C of another (strided rows);
    A = -exp(A_log) with Jamba's initialisation spread; dt around softplus's bend."""
    proj = randn(T, 3 * Dm + 8, dtype=dtype)
    x, dt, z = proj[:, 8:8 + Dm], proj[:, 8 + Dm:8 + 2 * Dm] - 1.0, proj[:, 8 + 2 * Dm:]
    bc = randn(T, 2 * N + 5, dtype=dtype)
    B, C = bc[:, 5:5 + N], bc[:, 5 + N:]
    A = -torch.exp(torch.log(torch.arange(1, N + 1, device=DEVICE, dtype=torch.float32)).expand(Dm, N)
                   + 0.3 * torch.randn(Dm, N, device=DEVICE)).contiguous()
    D = randn(Dm, dtype=torch.float32) if with_D else None
    dt_bias = randn(Dm, dtype=torch.float32, scale=0.5) if with_bias else None
    return x, dt, A, B, C, D, dt_bias, (z if with_z else None)


CASES = {  # lens, Dm, N, D, dt_bias, z
    "ragged-D-bias-z": ([1, 37, 5, 0, 70, 2], 40, 16, True, True, True),
    "noD-nobias-noz-N12": ([3, 1, 66], 24, 12, False, False, False),
}


@pytest.mark.parametrize("impl", [selective_scan_varlen, selective_scan_varlen_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_scan_varlen(impl, dtype, case):
    lens, Dm, N, with_D, with_bias, with_z = CASES[case]
    batch = Batch(lens, seed=len(case) + Dm)
    x, dt, A, B, C, D, dt_bias, z = scan_inputs(batch.T, Dm, N, dtype, with_D, with_bias, with_z)
    buf, state = state_pool(batch, (Dm, N), dtype)
    before = state.clone()
    expect = before.double()
    ref = selective_scan_varlen_ref(x.double(), dt.double(), A.double(), B.double(), C.double(), dbl(D), dbl(dt_bias),
                                    expect, *batch.args(), z=dbl(z))
    out = torch.full((batch.T, Dm), float("nan"), device=DEVICE, dtype=dtype)
    impl(x, dt, A, B, C, D, dt_bias, state, *batch.args(), z=z, out=out)
    assert rel_err(out, ref) < TOL[dtype]
    check_pages(state, before, expect, batch.written, TOL[dtype], buf)


@pytest.mark.parametrize("impl", [selective_scan_update, selective_scan_update_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_extras", [True, False])
def test_scan_update(impl, dtype, with_extras):
    S, Dm, N, num_pages = 6, 40, 16, 12
    x, dt, A, B, C, D, dt_bias, z = scan_inputs(S, Dm, N, dtype, with_extras, with_extras, with_extras)
    init = i32([3, 0, 5, -1, 9, 7])
    write = i32([3, 4, 0, 1, 10, -1])  # in place, fresh page, skipped (0, -1)
    buf = torch.full((num_pages, 2, Dm, N), float("nan"), device=DEVICE, dtype=dtype)
    state = buf[:, 1]
    for p in (3, 5, 9, 7):
        state[p] = randn(Dm, N, dtype=dtype)
    before = state.clone()
    expect = before.double()
    ref = selective_scan_update_ref(x.double(), dt.double(), A.double(), B.double(), C.double(), dbl(D),
                                    dbl(dt_bias), expect, init, write, z=dbl(z))
    out = torch.full((S, Dm), float("nan"), device=DEVICE, dtype=dtype)
    impl(x, dt, A, B, C, D, dt_bias, state, init, write, z=z, out=out)
    assert rel_err(out, ref) < TOL[dtype]
    check_pages(state, before, expect, [3, 4, 1, 10], TOL[dtype], buf)


def test_varlen_equals_decode_steps():
    """Independent of the references: the prefill kernel over three sequences (random chunks,
    checkpoints) equals the decode kernel run token by token in place on one page: outputs,
    checkpoints and final states."""
    Dm, N = 40, 16
    batch = Batch([30, 3, 20], seed=5, skip_frac=0.0)
    x, dt, A, B, C, D, dt_bias, z = scan_inputs(batch.T, Dm, N, torch.float32, True, True, True)
    buf, state = state_pool(batch, (Dm, N), torch.float32)
    before = state.clone()
    out = selective_scan_varlen(x, dt, A, B, C, D, dt_bias, state, *batch.args(), z=z)
    pool = before[:2].clone()  # page 1: the running state
    one = i32([1])
    ends = {int(batch.chunk_start[c + 1]) - 1: int(batch.chunk_page[c]) for c in range(batch.NC)}
    qsl, dec, ckpts = batch.qsl.tolist(), [], 0
    for s in range(batch.S):
        p = int(batch.init[s])
        pool[1] = before[p] if p > 0 else 0
        for t in range(qsl[s], qsl[s + 1]):
            sl = slice(t, t + 1)
            dec.append(selective_scan_update(x[sl], dt[sl], A, B[sl], C[sl], D, dt_bias, pool, one, one, z=z[sl]))
            if ends.get(t, 0) > 0:
                assert rel_err(state[ends[t]], pool[1]) < 1e-6
                ckpts += 1
    assert ckpts == len(batch.written) and buf[:, 0].isnan().all()
    assert rel_err(out, torch.cat(dec)) < 1e-6


def test_reference_equals_transformers_jamba_functions():
    """transformers' Jamba `mamba_selective_scan` (zero initial state, final state returned) and
    `mamba_selective_state_update` (in place) in float64 against our references."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan, mamba_selective_state_update
    L, Dm, N = 23, 24, 16
    x, dt, A, B, C, D, dt_bias, z = (t.double() if t is not None else None
                                     for t in scan_inputs(L, Dm, N, torch.float32, True, True, True))
    want, final = mamba_selective_scan(x.T[None], dt.T[None], A, B.T[None], C.T[None], D=D, z=z.T[None],
                                       delta_bias=dt_bias, delta_softplus=True, return_last_state=True)
    state = torch.full((3, Dm, N), float("nan"), dtype=torch.float64, device=DEVICE)
    got = selective_scan_varlen_ref(x, dt, A, B, C, D, dt_bias, state, i32([0, L]), i32([0]), i32([0, 9, L]),
                                    i32([0, 0]), i32([-1, 2]), z=z)
    assert rel_err(got, want[0].T) < 1e-12 and rel_err(state[2], final[0]) < 1e-12
    # one decode step from that state (transformers computes this one's decay and input in fp32)
    x1, dt1, B1, C1, z1 = (randn(1, *shape, dtype=torch.float64) for shape in ((Dm,), (Dm,), (N,), (N,), (Dm,)))
    hf_state = final.clone()
    want = mamba_selective_state_update(hf_state, x1, dt1, A, B1, C1, D, dt_bias=dt_bias, dt_softplus=True, z=z1)
    got = selective_scan_update_ref(x1, dt1, A, B1, C1, D, dt_bias, state, i32([2]), i32([1]), z=z1)
    assert rel_err(got, want) < 1e-6 and rel_err(state[1], hf_state[0]) < 1e-6


@pytest.mark.gpu
def test_kernels_in_cuda_graphs_equal_the_references():
    """The decode step captured in a CUDA graph and replayed on new inputs in place (as the
    engine's decode graphs do), and the prefill scan eagerly on a larger ragged batch, bf16
    states, against the float64 references."""
    Dm, N, S = 512, 16, 8
    dtype = torch.bfloat16
    x, dt, A, B, C, D, dt_bias, z = scan_inputs(S, Dm, N, dtype, True, True, True)
    pages = torch.full((S + 1, Dm, N), float("nan"), device=DEVICE, dtype=dtype)
    pages[1:] = randn(S, Dm, N, dtype=dtype)
    init = torch.arange(1, S + 1, device=DEVICE, dtype=torch.int32)
    out = torch.empty(S, Dm, device=DEVICE, dtype=dtype)
    selective_scan_update(x, dt, A, B, C, D, dt_bias, pages.clone(), init, init, z=z, out=out)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selective_scan_update(x, dt, A, B, C, D, dt_bias, pages, init, init, z=z, out=out)
    for _ in range(3):
        new = scan_inputs(S, Dm, N, dtype, True, True, True)
        for dst, src in zip((x, dt, B, C, z), (new[0], new[1], new[3], new[4], new[7])):
            dst.copy_(src)
        expect = pages.double()
        ref = selective_scan_update_ref(x.double(), dt.double(), A.double(), B.double(), C.double(), D.double(),
                                        dt_bias.double(), expect, init, init, z=z.double())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref) < TOL[dtype] and rel_err(pages[1:], expect[1:]) < TOL[dtype]
    batch = Batch([1, 300, 65, 0, 7, 129], seed=3)
    x, dt, A, B, C, D, dt_bias, z = scan_inputs(batch.T, Dm, N, dtype, True, True, True)
    buf, state = state_pool(batch, (Dm, N), dtype)
    before = state.clone()
    expect = before.double()
    ref = selective_scan_varlen_ref(x.double(), dt.double(), A.double(), B.double(), C.double(), D.double(),
                                    dt_bias.double(), expect, *batch.args(), z=z.double())
    out = torch.full((batch.T, Dm), float("nan"), device=DEVICE, dtype=dtype)
    selective_scan_varlen(x, dt, A, B, C, D, dt_bias, state, *batch.args(), z=z, out=out)
    assert rel_err(out, ref) < TOL[dtype]
    check_pages(state, before, expect, batch.written, TOL[dtype], buf)


def test_bench_inputs_build_and_run_on_cpu():
    """kernels.bench.mamba1 builds its inputs with any sizes; tiny ones through the references
    equal transformers' scan there (zero initial states), and the decode arguments run."""
    from kernels.bench import mamba1 as bench
    inp = bench.scan_inputs(batch=2, seq_len=70, channels=24, N=16, device=DEVICE, dtype=torch.float32)
    inp["ssm_state"].zero_()
    out = selective_scan_varlen_ref(**inp)
    assert rel_err(out, bench.hf_scan(inp, 2, 70)) < 1e-5
    args = bench.decode_args(bench.scan_inputs(batch=3, seq_len=1, channels=24, N=16, device=DEVICE))
    assert selective_scan_update_ref(**args).shape == (3, 24)
