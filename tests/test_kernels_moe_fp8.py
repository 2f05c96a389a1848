"""FP8 experts (`kernels.fused_moe` with `ExpertScales`): the grouped GEMMs reading e4m3 weights
with block or per-row scales, against the float64 loop over the dequantized weights (on CPU
under TRITON_INTERPRET=1, natively on a GPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.activation import relu2, relu2_ref, silu_and_mul, silu_and_mul_ref
from kernels.fp8 import FP8_DTYPE, quantize_fp8_ref
from kernels.fused_moe import ExpertScales, _grouped_gemm, fused_experts, fused_experts_ref, row_tiles
from kernels.moe_gemv import takes as gemv_takes
from tests.test_kernels_moe import DEVICE, SMALL, oracle, rel_err, routing

# bf16 activations through exact FP8 products: the error is x's and the activation's rounding.
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
# Tiles whose K step (32) is a quarter of a 128-key block and whose 32 rows lie in one 32-row block.
FP8_SMALL = dict(SMALL, BLOCK_K=32)


def fp8_experts(e: int, inter: int, h: int, block: tuple[int, int] | None, seed: int, gated: bool = True):
    """(w13, w2 in FP8, their ExpertScales, the dequantized weights in float64); w13 [E, 2I, H]
    (gate rows, then up rows) or, not `gated`, [E, I, H]."""
    g = torch.Generator().manual_seed(seed)
    stacks, scales, deq = [], [], []
    for n, k in (((2 if gated else 1) * inter, h), (h, inter)):
        ws, ss, ds = [], [], []
        for _ in range(e):
            w = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g)) / k ** 0.5
            q, s = quantize_fp8_ref(w, block)
            ws.append(q)
            ss.append(s)
            full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1) if block else s[:, None]
            ds.append(q.double() * full.double())
        stacks.append(torch.stack(ws).to(DEVICE))
        scales.append(torch.stack(ss).to(DEVICE))
        deq.append(torch.stack(ds).to(DEVICE))
    return stacks[0], stacks[1], ExpertScales(scales[0], scales[1], block), deq[0], deq[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("block", [(32, 64), None], ids=["block", "row"])
@pytest.mark.parametrize("t,cfg", [(1, FP8_SMALL), (9, FP8_SMALL), (40, None), (1, None), (3, None)],
                         ids=["one-token", "tiles", "default", "gemv-one", "gemv-three"])
def test_fp8_experts_against_a_float64_loop(dtype, block, t, cfg):
    e, k, h, inter = 5, 2, 128, 64
    w13, w2, scales, d13, d2 = fp8_experts(e, inter, h, block, seed=t)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t + 1)).to(DEVICE, dtype)
    weights, ids = routing(t, e, k, seed=t, skip=(0,))
    w13[0] = w2[0] = torch.tensor(float("nan")).to(FP8_DTYPE)  # expert 0 unused: never read
    ref = oracle(x, d13, d2, weights, ids)
    if cfg is None:  # the default path: GEMVs up to GEMV_MAX_TOKENS, then the grouped GEMMs
        assert gemv_takes(t, inter) == (t <= 4)
    got = fused_experts(x, w13, w2, weights, ids, silu_and_mul, config=cfg, scales=scales)
    assert got.shape == (t, h) and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(fused_experts_ref(x, w13, w2, weights, ids, silu_and_mul_ref, scales=scales), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("block", [(32, 64), None], ids=["block", "row"])
@pytest.mark.parametrize("t,cfg", [(1, FP8_SMALL), (9, FP8_SMALL), (40, None), (2, None)],
                         ids=["one-token", "tiles", "default", "gemv-two"])
def test_fp8_experts_without_a_gate(dtype, block, t, cfg):
    """Nemotron-H's FP8 experts (NVIDIA's checkpoints): w13 of up rows alone, relu^2, each row's
    scale applied before the activation; against float64, expert 0 NaN and never chosen."""
    e, k, h, inter = 5, 2, 128, 64
    w13, w2, scales, d13, d2 = fp8_experts(e, inter, h, block, seed=t + 7, gated=False)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t + 3)).to(DEVICE, dtype)
    weights, ids = routing(t, e, k, seed=t + 5, skip=(0,))
    w13[0] = w2[0] = torch.tensor(float("nan")).to(FP8_DTYPE)
    ref = torch.zeros(t, h, dtype=torch.float64, device=DEVICE)
    for p in range(t * k):
        ex, tok = int(ids.flatten()[p]), p // k
        a = torch.relu(d13[ex] @ x[tok].double()) ** 2
        ref[tok] += weights.flatten()[p].double() * (d2[ex] @ a)
    got = fused_experts(x, w13, w2, weights, ids, relu2, config=cfg, scales=scales)
    assert got.shape == (t, h) and got.dtype == dtype
    tol = 2 * TOL[dtype]  # the square doubles the relative error of the rounded up-projection
    assert rel_err(got, ref) < tol
    assert rel_err(fused_experts_ref(x, w13, w2, weights, ids, relu2_ref, scales=scales), ref) < tol


@pytest.mark.parametrize("t,cfg", [(1, None), (3, None), (9, FP8_SMALL)], ids=["gemv-one", "gemv-three", "tiles"])
def test_fp8_experts_with_the_weights_on_their_input(t, cfg):
    """Llama-4's experts (`weight_input`): sum_j W2 act(W13 (w_tj x_t)), fp32, against float64."""
    e, k, h, inter = 5, 2, 128, 64
    w13, w2, scales, d13, d2 = fp8_experts(e, inter, h, (32, 64), seed=t + 30)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t + 31)).to(DEVICE)
    weights, ids = routing(t, e, k, seed=t + 32)
    ref = torch.zeros(t, h, dtype=torch.float64, device=DEVICE)
    for tok in range(t):
        for j in range(k):
            g = d13[int(ids[tok, j])] @ (weights[tok, j].double() * x[tok].double())
            ref[tok] += d2[int(ids[tok, j])] @ (torch.nn.functional.silu(g[:inter]) * g[inter:])
    got = fused_experts(x, w13, w2, weights, ids, silu_and_mul, config=cfg, weight_input=True, scales=scales)
    assert rel_err(got, ref) < TOL[torch.float32]


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
def test_one_token_through_wide_fp8_experts_takes_the_gemvs(gated):
    """FP8 experts wider than GEMV_MAX_INTERMEDIATE (Nemotron-3-Nano's 1,856) take the GEMVs for
    one token only; fp32 activations, against float64."""
    e, k, h, inter = 4, 2, 128, 640
    assert gemv_takes(1, inter, fp8=True) and not gemv_takes(1, inter) and not gemv_takes(2, inter, fp8=True)
    w13, w2, scales, d13, d2 = fp8_experts(e, inter, h, None, seed=21, gated=gated)
    x = torch.randn(1, h, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    weights, ids = routing(1, e, k, seed=23)
    if gated:
        act, ref = silu_and_mul, oracle(x, d13, d2, weights, ids)
    else:
        act = relu2
        ref = sum(weights[0, j].double() * (d2[int(ids[0, j])] @ torch.relu(d13[int(ids[0, j])] @ x[0].double()) ** 2)
                  for j in range(k))[None]
    assert rel_err(fused_experts(x, w13, w2, weights, ids, act, scales=scales), ref) < TOL[torch.float32]


@pytest.mark.parametrize("block", [(16, 32), None], ids=["block", "row"])
def test_fp8_grouped_gemm_writes_each_pair_row_once_and_nothing_else(block):
    """One launch, fp32 activations, a NaN-poisoned output whose rows are views of wider rows:
    every pair's row is its expert's product with the dequantized weight; the columns beside it
    untouched."""
    e, k, t, kdim, n = 4, 2, 5, 64, 48
    g = torch.Generator().manual_seed(11)
    a = torch.randn(t * k, kdim, generator=g).to(DEVICE)
    qs, ss, ds = [], [], []
    for _ in range(e):
        q, s = quantize_fp8_ref(torch.randn(n, kdim, generator=g), block)
        qs.append(q)
        ss.append(s)
        full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1) if block else s[:, None]
        ds.append(q.double() * full.double())
    w, scale, deq = torch.stack(qs).to(DEVICE), torch.stack(ss).to(DEVICE), torch.stack(ds).to(DEVICE)
    weights, ids = routing(t, e, k, seed=2)
    tiles = row_tiles(ids, e, SMALL["BLOCK_M"])
    wide = torch.full((t * k, n + 3), float("nan"), device=DEVICE)
    out = wide[:, :n]
    _grouped_gemm(a, w, None, tiles, out, None, 1, dict(SMALL, BLOCK_K=32), None, scale, block)
    flat = ids.flatten()
    for p in range(t * k):
        want = deq[flat[p]] @ a[p].double()
        assert torch.allclose(out[p].double(), want, rtol=1e-5, atol=1e-5), p
    assert torch.isnan(wide[:, n:]).all(), "wrote outside the output rows"


def test_fp8_expert_scales_are_checked():
    w13, w2, scales, _, _ = fp8_experts(3, 64, 128, (32, 64), seed=0)
    x = torch.zeros(1, 128, device=DEVICE)
    weights, ids = routing(1, 3, 2, seed=0)
    with pytest.raises(ValueError, match=r"w13: FP8 expert scales must be \(3, 4, 2\)"):
        fused_experts(x, w13, w2, weights, ids, silu_and_mul, scales=ExpertScales(scales.w13[:, :2], scales.w2,
                                                                                      (32, 64)))
    with pytest.raises(ValueError, match="must tile its rows and keys whole"):
        fused_experts(x, w13, w2, weights, ids, silu_and_mul, scales=ExpertScales(scales.w13, scales.w2, (48, 64)))
    with pytest.raises(TypeError, match="FP8 experts need"):
        fused_experts(x, w13.float(), w2, weights, ids, silu_and_mul, scales=scales)
    with pytest.raises(TypeError, match="must be float32"):
        fused_experts(x, w13, w2, weights, ids, silu_and_mul,
                      scales=ExpertScales(scales.w13.half(), scales.w2, (32, 64)))
