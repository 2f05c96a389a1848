"""The mixture-of-experts kernels against a float64 loop over tokens and their experts, written
here without the kernels' sort (on CPU under TRITON_INTERPRET=1, natively on a GPU)."""
from __future__ import annotations

import pytest
import torch

from kernels import fused_moe
from kernels.activation import fusable, relu2, relu2_ref, silu_and_mul, silu_and_mul_ref
from kernels.fused_moe import (_grouped_gemm, fused_experts, fused_experts_ref, moe_align, moe_align_kernel, row_tiles,
                               moe_align_torch, moe_config, tokens_per_tile_band)
from kernels.moe_gemv import GEMV_MAX_INTERMEDIATE, GEMV_MAX_TOKENS, _launch, experts_gemv
from kernels.moe_routing import (topk_sigmoid, topk_sigmoid_grouped, topk_sigmoid_grouped_ref, topk_sigmoid_ref,
                                 topk_softmax, topk_softmax_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}
SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
LARGE = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}


def oracle(x, w13, w2, weights, ids, b13=None, b2=None) -> torch.Tensor:
    """y[t] = sum_j w[t, j] * (W2 silu-gated(W13 x[t] + b13) + b2), all in float64, token by token."""
    x, w13, w2, weights = x.double(), w13.double(), w2.double(), weights.double()
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t] + (b13[e].double() if b13 is not None else 0)
            h = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += weights[t, j] * (w2[e] @ h + (b2[e].double() if b2 is not None else 0))
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output (unwritten or poisoned rows)"
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def routing(t: int, e: int, k: int, seed: int, skip: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token (never one in `skip`), softmax-like weights."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e, generator=g)
    scores[:, list(skip)] = -1.0
    vals, ids = scores.topk(k, dim=1)
    return (vals / vals.sum(1, keepdim=True)).to(DEVICE), ids.to(DEVICE)


def expert_weights(e: int, inter: int, h: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter ** 0.5).to(DEVICE, dtype)
    return w13, w2


@pytest.mark.parametrize("impl", [moe_align_torch, moe_align_kernel], ids=["torch", "triton"])
@pytest.mark.parametrize("t,e,k,block_m", [(t, e, k, b) for t, e, k in [(1, 8, 2), (5, 6, 3), (40, 4, 2), (3, 16, 1),
                                                                       (70, 128, 4), (9, 100, 8)]
                                           for b in (1, 4, 16)] + [(200, 257, 8, 16)])  # the widest sort
def test_moe_align_groups_every_pair_once_by_expert(impl, t, e, k, block_m):
    """Both implementations (one Triton program for a decode step's pairs, torch ops beyond),
    each against the contract, and the two equal."""
    _, ids = routing(t, e, k, seed=t * 100 + e, skip=(e - 1,))
    rows, block_expert = impl(ids, e, block_m)
    want = moe_align_torch(ids, e, block_m)
    assert torch.equal(rows, want[0]) and torch.equal(block_expert, want[1])
    n = t * k
    assert rows.numel() == -(-(n + min(n, e) * (block_m - 1)) // block_m) * block_m
    assert block_expert.numel() == rows.numel() // block_m
    real = rows[rows < n]
    assert sorted(real.tolist()) == list(range(n)), "every (token, j) pair exactly once"
    assert (rows[rows >= n] == n).all(), "padding rows hold the sentinel"
    flat = ids.flatten()
    used = 0
    for b, ex in enumerate(block_expert.tolist()):
        tile = rows[b * block_m:(b + 1) * block_m]
        tile = tile[tile < n]
        if ex < 0:
            assert tile.numel() == 0
            continue
        used = b + 1
        assert tile.numel() > 0, "a tile with an expert holds at least one pair"
        assert (flat[tile.long()] == ex).all(), "a tile's pairs all use its expert"
    assert (block_expert[used:] == -1).all() and (block_expert[:used] >= 0).all()
    assert (block_expert[:used].diff() >= 0).all(), "tiles in expert order"
    assert (e - 1) not in block_expert.tolist(), "an expert no token chose has no tile"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("t,e,k,h,inter,cfg", [
    (1, 8, 2, 64, 32, SMALL),  # a decode step: every tile mostly padding
    (7, 6, 3, 40, 24, SMALL),  # ragged H and I: masked columns and a partial K step
    (37, 4, 2, 64, 48, LARGE),  # 64-row tiles, experts with many rows
    (9, 5, 2, 32, 16, None),  # the default tile rule: 16-row tiles
    (40, 3, 2, 48, 40, None),  # ... and its 64-row tiles (27 rows per expert)
])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_fused_experts_against_a_float64_loop(dtype, t, e, k, h, inter, cfg, bias):
    g = torch.Generator().manual_seed(t + e)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w13, w2 = expert_weights(e, inter, h, dtype, seed=e)
    weights, ids = routing(t, e, k, seed=t, skip=(0,))  # expert 0 unused: its weights never read
    b13 = (torch.randn(e, 2 * inter, generator=g) * 0.5).to(DEVICE, dtype) if bias else None
    b2 = (torch.randn(e, h, generator=g) * 0.5).to(DEVICE, dtype) if bias else None
    w13[0], w2[0] = float("nan"), float("nan")
    ref = oracle(x, w13, w2, weights, ids, b13, b2)
    got = fused_experts(x, w13, w2, weights, ids, silu_and_mul, b13, b2, config=cfg)
    assert got.shape == (t, h) and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    assert rel_err(fused_experts_ref(x, w13, w2, weights, ids, silu_and_mul_ref, b13, b2), ref) < TOL[dtype]


@pytest.mark.parametrize("t", [6, 1], ids=["aligned", "one-token"])
@pytest.mark.parametrize("a_row_div,routed", [(2, False), (1, True)], ids=["gate_up", "down"])
def test_grouped_gemm_writes_each_pair_row_once_and_nothing_else(a_row_div, routed, t):
    """One launch on its own: a NaN-poisoned output whose rows are views of wider rows: every pair's
    row written with its expert's product (scaled by its routing weight in the second launch),
    the columns beside it untouched; the rows as aligned, or for one token a tile a pair."""
    e, k, kdim, n = 5, 2, 48, 40
    g = torch.Generator().manual_seed(7)
    a = torch.randn(t * k // a_row_div, kdim, generator=g).to(DEVICE)
    w = torch.randn(e, n, kdim, generator=g).to(DEVICE)
    weights, ids = routing(t, e, k, seed=3)
    tiles = row_tiles(ids, e, SMALL["BLOCK_M"])
    assert tiles.pair_tiles == (t == 1)
    wide = torch.full((t * k, n + 3), float("nan"), device=DEVICE)
    out = wide[:, :n]
    _grouped_gemm(a, w, None, tiles, out, weights.reshape(-1) if routed else None, a_row_div, SMALL)
    flat = ids.flatten()
    for p in range(t * k):
        want = w[flat[p]].double() @ a[p // a_row_div].double()
        if routed:
            want = want * weights.reshape(-1)[p].double()
        assert torch.allclose(out[p].double(), want, rtol=1e-5, atol=1e-5), p
    assert torch.isnan(wide[:, n:]).all(), "wrote outside the output rows"


def test_moe_config_rule_and_empty_batch():
    assert [moe_config(pairs, 64)["BLOCK_M"] for pairs in (6, 768, 769, 1536, 1537, 4096, 4097)] == \
        [16, 16, 32, 32, 64, 64, 128]
    for e, k in ((64, 6), (32, 4), (8, 2), (128, 1)):  # warm-up batches: one in each band
        assert [moe_config(t * k, e)["BLOCK_M"] for t in tokens_per_tile_band(e, k)] == [16, 32, 64, 128]
    assert moe_config(4097, 64, itemsize=4)["BLOCK_M"] == 64  # fp32's tiles must fit in shared memory
    w13, w2 = expert_weights(4, 8, 16, torch.float32, seed=0)
    x = torch.zeros(0, 16, device=DEVICE)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    assert fused_experts(x, w13, w2, ids.float(), ids, silu_and_mul).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_default_tiles_of_every_band(dtype):
    """`fused_experts` with the tiles it picks itself, one batch in each band (prefill's 128 x 256
    tiles included for 16-bit operands), against the float64 loop."""
    e, k, h, inter = 4, 2, 64, 32
    w13, w2 = expert_weights(e, inter, h, dtype, seed=5)
    for t in tokens_per_tile_band(e, k):
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(DEVICE, dtype)
        weights, ids = routing(t, e, k, seed=t)
        out = fused_experts(x, w13, w2, weights.to(dtype), ids, silu_and_mul)
        assert rel_err(out, oracle(x, w13, w2, weights.to(dtype), ids)) < TOL[dtype], (t, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("t,e,k,h,inter", [
    (1, 8, 2, 64, 32),  # a decode step
    (3, 6, 3, 96, 64),  # H = 96: a partial K step
    (GEMV_MAX_TOKENS, 6, 4, 64, 32),  # the most tokens the GEMVs take: experts shared between tokens
])
def test_few_tokens_run_as_gemvs(dtype, t, e, k, h, inter, monkeypatch):
    """Up to GEMV_MAX_TOKENS tokens `fused_experts` takes the GEMV path, with biases, against the
    float64 loop and the grouped GEMMs; an expert no token chose holds NaN and is never read."""
    taken = []
    monkeypatch.setattr(fused_moe, "experts_gemv", lambda *a, **k: taken.append(1) or experts_gemv(*a, **k))
    g = torch.Generator().manual_seed(t + e)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w13, w2 = expert_weights(e, inter, h, dtype, seed=e)
    weights, ids = routing(t, e, k, seed=t, skip=(0,))
    weights = weights.to(dtype)
    b13 = (torch.randn(e, 2 * inter, generator=g) * 0.5).to(DEVICE, dtype)
    b2 = (torch.randn(e, h, generator=g) * 0.5).to(DEVICE, dtype)
    grouped = fused_experts(x, w13, w2, weights, ids, silu_and_mul, b13, b2, config=SMALL)
    assert not taken
    for w in (w13, w2, b13, b2):
        w[0] = float("nan")
    got = fused_experts(x, w13, w2, weights, ids, silu_and_mul, b13, b2)
    assert taken and got.shape == (t, h) and got.dtype == dtype
    assert rel_err(got, oracle(x, w13, w2, weights, ids, b13, b2)) < TOL[dtype]
    assert rel_err(got, grouped.double()) < TOL[dtype] / 4


@pytest.mark.parametrize("variant", ["relu2", "weight_input", "unfused"])
def test_gemv_path_variants(variant, monkeypatch):
    """The GEMV path's other cases against the loop `fused_experts_ref`: experts without a gate
    (relu^2), router weights on the input, and an activation it cannot fuse (run after the raw
    gate/up product)."""
    taken = []
    monkeypatch.setattr(fused_moe, "experts_gemv", lambda *a, **k: taken.append(1) or experts_gemv(*a, **k))
    t, e, k, h, inter = 3, 6, 2, 64, 32
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    w13, w2 = expert_weights(e, inter, h, torch.float32, seed=4)
    weights, ids = routing(t, e, k, seed=5)
    act, kw = silu_and_mul, {}
    if variant == "relu2":
        w13, act = w13[:, :inter].contiguous(), relu2
    elif variant == "weight_input":
        kw = {"weight_input": True}
    else:
        act = lambda y: silu_and_mul(y)  # noqa: E731
    got = fused_experts(x, w13, w2, weights, ids, act, **kw)
    want = fused_experts_ref(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu(),
                             relu2_ref if variant == "relu2" else silu_and_mul_ref, **kw)
    assert taken and rel_err(got.cpu(), want.double()) < 1e-5
    if variant == "weight_input":  # (the weights do move the result)
        assert rel_err(fused_experts(x, w13, w2, weights, ids, act).cpu(), want.double()) > 0.05


@pytest.mark.parametrize("down", [False, True], ids=["gate_up", "down"])
def test_gemv_writes_each_output_row_once_and_nothing_else(down):
    """One GEMV launch into a NaN-poisoned output whose rows are views of wider rows: the gate/up
    launch (a row a pair, the activation of its gate and up rows, each token's row read for its k
    pairs) or the down launch (a row a token, the sum over its k pairs times their routing
    weights, a bias); each row its value, the columns beside it untouched."""
    t, e, k, kdim, n = 3, 5, 2, 96, 40
    g = torch.Generator().manual_seed(7)
    a = torch.randn(t * k if down else t, kdim, generator=g).to(DEVICE)
    w = (torch.randn(e, n, kdim, generator=g) / kdim ** 0.5).to(DEVICE)
    b = torch.randn(e, n, generator=g).to(DEVICE)
    weights, ids = routing(t, e, k, seed=3)
    flat = ids.flatten().contiguous()
    rows, cols = (t, n) if down else (t * k, n // 2)
    wide = torch.full((rows, cols + 3), float("nan"), device=DEVICE)
    out = wide[:, :cols]
    if down:
        _launch(a, w, b, flat, out, weights.reshape(-1).contiguous(), k, 1, n, None, None)
    else:
        _launch(a, w, b, flat, out, None, 1, k, cols, fusable(silu_and_mul), None)
    wd, ad, bd = w.double(), a.double(), b.double()
    for r in range(rows):
        if down:
            want = sum(weights.reshape(-1)[p].double() * (wd[flat[p]] @ ad[p] + bd[flat[p]])
                       for p in range(r * k, r * k + k))
        else:
            hv = wd[flat[r]] @ ad[r // k] + bd[flat[r]]
            want = torch.nn.functional.silu(hv[:cols]) * hv[cols:]
        assert rel_err(out[r], want) < 1e-5, r
    assert torch.isnan(wide[:, cols:]).all(), "wrote outside the output rows"


def test_wide_experts_and_more_tokens_take_the_grouped_gemms(monkeypatch):
    """Past GEMV_MAX_TOKENS tokens, or with experts wider than GEMV_MAX_INTERMEDIATE, the op
    runs the grouped GEMMs (still right)."""
    taken = []
    monkeypatch.setattr(fused_moe, "experts_gemv", lambda *a, **k: taken.append(1) or experts_gemv(*a, **k))
    for t, inter in ((1, GEMV_MAX_INTERMEDIATE + 8), (GEMV_MAX_TOKENS + 1, 16)):
        w13, w2 = expert_weights(4, inter, 32, torch.float32, seed=t)
        x = torch.randn(t, 32, generator=torch.Generator().manual_seed(t)).to(DEVICE)
        weights, ids = routing(t, 4, 2, seed=t)
        assert rel_err(fused_experts(x, w13, w2, weights, ids, silu_and_mul), oracle(x, w13, w2, weights, ids)) < 1e-5
    assert not taken


def test_gemv_refuses_a_chunk_that_does_not_divide_its_k_step():
    w13, w2 = expert_weights(4, 16, 32, torch.float32, seed=1)
    weights, ids = routing(1, 4, 2, seed=1)
    bad = {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 4, "CHUNK": 3}
    with pytest.raises(ValueError, match="CHUNK"):
        experts_gemv(torch.randn(1, 32, device=DEVICE), w13, w2, weights, ids, silu_and_mul,
                     fusable(silu_and_mul), None, None, False, (bad, bad))


@pytest.mark.parametrize("impl", [topk_softmax, topk_softmax_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("t,e,k", [(1, 64, 6), (5, 32, 4), (37, 72, 10), (3, 8, 1), (2, 128, 8), (4, 6, 6)])
def test_topk_softmax(impl, dtype, t, e, k):
    """Each token's k largest logits (largest first), their experts, and the softmax over the k,
    against a float64 evaluation; outputs poisoned."""
    g = torch.Generator().manual_seed(t * e + k)
    # Distinct values, exact in bf16 (torch orders equal logits as it likes; ties are tested below).
    logits = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).sub(e / 2).div(8).to(DEVICE, dtype)
    weights, ids = impl(logits, k, dtype)
    top, want_ids = logits.double().topk(k, dim=-1)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    assert weights.dtype == dtype and ids.dtype == torch.int64
    torch.testing.assert_close(weights.double(), torch.softmax(top, dim=-1), rtol=TOL[dtype], atol=TOL[dtype] / 10)


@pytest.mark.parametrize("impl", [topk_softmax, topk_softmax_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("shared", [1, 3])
def test_topk_softmax_with_a_shared_expert(impl, shared):
    """The shared expert's gate logit is the last column: its slots follow the k routed ones,
    experts E .. E + shared - 1, each weighed by the sigmoid of that logit."""
    t, e, k = 6, 16, 4
    g = torch.Generator().manual_seed(shared)
    routed = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).sub(e / 2).div(8)
    gate = torch.randn(t, 1, generator=g)
    logits = torch.cat([routed, gate], dim=1).to(DEVICE)
    weights, ids = impl(logits, k, torch.float32, shared)
    top, want_ids = routed.double().topk(k, dim=-1)
    assert ids.shape == (t, k + shared)
    assert torch.equal(ids[:, :k].cpu(), want_ids)
    assert torch.equal(ids[:, k:].cpu(), torch.arange(e, e + shared).expand(t, -1))
    torch.testing.assert_close(weights[:, :k].double().cpu(), torch.softmax(top, dim=-1))
    torch.testing.assert_close(weights[:, k:].double().cpu(), torch.sigmoid(gate.double()).expand(-1, shared))
    with pytest.raises(ValueError, match="experts per token must be 1 to 16"):
        impl(logits, 17, torch.float32, shared)


@pytest.mark.parametrize("impl", [topk_softmax, topk_softmax_ref], ids=["triton", "torch"])
def test_topk_softmax_over_all_experts_keeps_their_probabilities(impl):
    """Jamba, and Qwen3-Next without norm_topk_prob: the k chosen experts keep their softmax over
    all (with a shared expert's slot after them), against a float64 evaluation; and on random
    logits of 16 experts, 2 per token, as Jamba's router."""
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0, 0.5]], device=DEVICE)
    weights, ids = impl(logits, 2, torch.float32, 1, renormalize=False)
    probs = torch.softmax(logits[0, :4].double(), dim=0).cpu()
    assert ids.tolist() == [[1, 2, 4]]
    torch.testing.assert_close(weights[0].double().cpu(),
                               torch.stack([probs[1], probs[2], torch.sigmoid(torch.tensor(0.5).double())]))
    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    weights, ids = impl(logits, 2, torch.float32, renormalize=False)
    want, want_ids = torch.softmax(logits.double(), dim=-1).topk(2, dim=-1)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(weights.double(), want, rtol=1e-6, atol=1e-7)


def test_moe_align_kernel_limit():
    with pytest.raises(ValueError, match="at most 2048 pairs"):
        moe_align_kernel(torch.zeros(1025, 2, dtype=torch.int64, device=DEVICE), 4, 16)


def test_topk_softmax_ties_and_bad_arguments():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]], device=DEVICE)
    weights, ids = topk_softmax(logits, 3, torch.float32)
    assert ids.tolist() == [[1, 2, 4]]  # equal logits: the lower expert first
    torch.testing.assert_close(weights, torch.full((1, 3), 1 / 3, device=DEVICE))
    assert topk_softmax(torch.zeros(0, 5, device=DEVICE), 2, torch.float32)[1].shape == (0, 2)
    with pytest.raises(ValueError, match="experts per token must be 1 to 5"):
        topk_softmax(logits, 6, torch.float32)
    with pytest.raises(ValueError, match=r"\[tokens, experts\]"):
        topk_softmax(logits[0], 2, torch.float32)


def test_fused_experts_bad_arguments():
    w13, w2 = expert_weights(4, 8, 16, torch.float32, seed=0)
    x = torch.randn(3, 16, device=DEVICE)
    weights, ids = routing(3, 4, 2, seed=0)
    with pytest.raises(ValueError, match="expert shapes do not fit"):
        fused_experts(torch.randn(3, 12, device=DEVICE), w13, w2, weights, ids, silu_and_mul)
    with pytest.raises(ValueError, match="expert shapes do not fit"):
        fused_experts(x, w13, w2[:, :, :4], weights, ids, silu_and_mul)
    with pytest.raises(ValueError, match=r"topk_ids and topk_weights must both be \[3, k\]"):
        fused_experts(x, w13, w2, weights[:2], ids[:2], silu_and_mul)
    with pytest.raises(ValueError, match="biases must be"):
        fused_experts(x, w13, w2, weights, ids, silu_and_mul, b13=torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(TypeError, match="one dtype"):
        fused_experts(x.half(), w13, w2, weights, ids, silu_and_mul)
    with pytest.raises(ValueError, match=r"topk_ids must be \[tokens, k\]"):
        moe_align(ids.flatten(), 4, 16)
    with pytest.raises(ValueError, match="w13 needs contiguous rows"):  # a transposed [E, H, 2I] layout
        fused_experts(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids, silu_and_mul)


def test_the_layer_through_the_kernel_equals_its_reference():
    """`FusedMoE` as the engine runs it on a GPU (the Triton kernels, here under the interpreter)
    and on CPU (the torch loop): the same routing (top-k, softmax over the k) and the same sums."""
    from workers.layers.moe import FusedMoE
    from workers.parallel import TPGroup
    layer = FusedMoE(8, 3, 32, 24, "silu", TPGroup(), torch.float32, torch.device(DEVICE), "experts")
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        layer.w13.copy_(torch.randn(layer.w13.shape, generator=g) * 0.2)
        layer.w2.copy_(torch.randn(layer.w2.shape, generator=g) * 0.2)
    x = torch.randn(11, 32, generator=g).to(DEVICE)
    logits = torch.randn(11, 8, generator=g).to(DEVICE)
    top, ids = logits.topk(3, dim=-1)
    want = oracle(x, layer.w13, layer.w2, torch.softmax(top, dim=-1), ids)
    got = layer(x, logits)
    assert rel_err(got, want) < 1e-5
    assert rel_err(fused_experts(x, layer.w13, layer.w2, torch.softmax(top, dim=-1), ids, silu_and_mul), want) < 1e-5


@pytest.mark.parametrize("impl", [topk_sigmoid, topk_sigmoid_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("k", [1, 3])
def test_topk_sigmoid(impl, shared, k):
    """Llama-4's choice: the k largest logits, each weighed by its own sigmoid (no softmax), and a
    shared expert without a gate: its slots weigh 1 and the logits have no column for it."""
    t, e = 5, 16
    g = torch.Generator().manual_seed(k + shared)
    logits = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).sub(e / 2).div(8).to(DEVICE)
    weights, ids = impl(logits, k, torch.float32, shared)
    top, want_ids = logits.double().topk(k, dim=-1)
    assert ids.shape == weights.shape == (t, k + shared)
    assert torch.equal(ids[:, :k].cpu(), want_ids.cpu())
    assert torch.equal(ids[:, k:].cpu(), torch.arange(e, e + shared).expand(t, -1))
    torch.testing.assert_close(weights[:, :k].double().cpu(), torch.sigmoid(top).cpu())
    assert (weights[:, k:] == 1).all()
    with pytest.raises(ValueError, match="experts per token must be 1 to 16"):
        impl(logits, 17, torch.float32, shared)


@pytest.mark.parametrize("experts,shared_gate,bias", [(13, True, False), (16, False, False), (6, False, True)],
                         ids=["257-like", "aligned", "bias"])
def test_router_pads_its_rows_and_gives_the_logits_of_its_checkpoint(experts, shared_gate, bias):
    """The router's weight (and bias) hold zero rows up to a multiple of 8 (aligned outputs for
    cuBLAS); its logits are those of the checkpoint's rows alone, the shared gate's last."""
    from workers.layers.moe import Router
    g = torch.Generator().manual_seed(5)
    h = 32
    r = Router(h, experts, torch.float32, torch.device(DEVICE), bias=bias, shared_gate=shared_gate, name="r")
    rows = experts + shared_gate
    assert r.weight.shape[0] % 8 == 0 and r.weight.shape[0] - rows < 8
    w, sg = torch.randn(experts, h, generator=g), torch.randn(1, h, generator=g)
    b = torch.randn(experts, generator=g)
    r.weight_loader(r.weight, w)
    if shared_gate:
        r.weight_loader(r.weight, sg, "shared")
    if bias:
        r.weight_loader(r.bias, b)
    assert not r.weight[rows:].any() and (r.bias is None or not r.bias[experts:].any())
    for t in (1, 5, 40):  # the GEMV, the skinny GEMM, F.linear
        x = torch.randn(t, h, generator=g)
        want = x.double() @ torch.cat([w, sg] if shared_gate else [w]).double().T + (b.double() if bias else 0)
        got = r(x.to(DEVICE))
        assert got.shape == (t, rows) and torch.allclose(got.double().cpu(), want, atol=1e-4)
    with pytest.raises(ValueError, match="shape"):
        r.weight_loader(r.weight, torch.randn(experts + 1, h))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_weights_on_the_experts_input(dtype):
    """`weight_input` (Llama-4): sum_j W2 act(W13 (w_tj x_t)), the weight scaling each pair's input
    (the first launch's rows) and not its output; the same through the layer; biases refused."""
    from workers.layers.moe import FusedMoE
    from workers.parallel import TPGroup
    t, e, k, h, inter = 9, 5, 2, 32, 24
    g = torch.Generator().manual_seed(11)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w13, w2 = expert_weights(e, inter, h, dtype, seed=3)
    weights, ids = routing(t, e, k, seed=4)
    weights = (weights * 3).to(dtype)  # far from 1, where input and output scaling differ most
    ref = torch.zeros(t, h, dtype=torch.float64)
    for p in range(t * k):
        ex, tok = int(ids.flatten()[p]), p // k
        a = w13[ex].double() @ (weights.flatten()[p].double() * x[tok].double())
        ref[tok] += (w2[ex].double() @ (torch.nn.functional.silu(a[:inter]) * a[inter:])).cpu()
    got = fused_experts(x, w13, w2, weights, ids, silu_and_mul, config=SMALL, weight_input=True)
    assert rel_err(got.cpu(), ref) < TOL[dtype]
    assert rel_err(fused_experts_ref(x, w13, w2, weights, ids, silu_and_mul_ref, weight_input=True).cpu(), ref) \
        < TOL[dtype]
    assert rel_err(fused_experts(x, w13, w2, weights, ids, silu_and_mul, config=SMALL).cpu(), ref) > 0.05
    with pytest.raises(ValueError, match="without biases"):
        fused_experts(x, w13, w2, weights, ids, silu_and_mul, b13=torch.zeros(e, 2 * inter, device=DEVICE,
                                                                             dtype=dtype), weight_input=True)
    layer = FusedMoE(e, 1, h, inter, "silu", TPGroup(), torch.float32, torch.device(DEVICE), "experts",
                     shared_intermediate=inter, scoring="sigmoid", weight_input=True)
    with torch.no_grad():
        layer.w13.copy_(torch.randn(layer.w13.shape, generator=g) * 0.2)
        layer.w2.copy_(torch.randn(layer.w2.shape, generator=g) * 0.2)
    x = x.float()
    logits = torch.randn(t, e, generator=g).to(DEVICE)
    top, top_ids = logits.topk(1, dim=-1)
    ids = torch.cat([top_ids, torch.full_like(top_ids, e)], dim=1)  # the shared expert's slot, weight 1
    want = fused_experts_ref(x, layer.w13, layer.w2, torch.cat([torch.sigmoid(top), torch.ones_like(top)], 1), ids,
                             silu_and_mul_ref, weight_input=True)
    assert rel_err(layer(x, logits), want.double()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("t,cfg", [(1, SMALL), (7, SMALL), (37, LARGE), (9, None)])
def test_experts_without_a_gate(dtype, t, cfg):
    """Nemotron-H's experts: w13 is [E, I, H] (up rows alone) and the activation elementwise,
    sum_j w_tj W2 relu(W13 x_t)^2, against float64; expert 0 NaN and never chosen."""
    e, k, h, inter = 6, 2, 40, 24
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(e, inter, h, generator=g) / h ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter ** 0.5).to(DEVICE, dtype)
    weights, ids = routing(t, e, k, seed=t + 1, skip=(0,))
    w13[0], w2[0] = float("nan"), float("nan")
    ref = torch.zeros(t, h, dtype=torch.float64)
    for p in range(t * k):
        ex, tok = int(ids.flatten()[p]), p // k
        a = torch.relu(w13[ex].double() @ x[tok].double()) ** 2
        ref[tok] += (weights.flatten()[p].double() * (w2[ex].double() @ a)).cpu()
    got = fused_experts(x, w13, w2, weights, ids, relu2, config=cfg)
    assert got.shape == (t, h) and got.dtype == dtype
    assert rel_err(got.cpu(), ref) < TOL[dtype]
    assert rel_err(fused_experts_ref(x, w13, w2, weights, ids, relu2_ref).cpu(), ref) < TOL[dtype]
    with pytest.raises(ValueError, match="expert shapes do not fit"):
        fused_experts(x, w13[:, :inter - 1], w2, weights, ids, relu2)


def grouped_oracle(logits, bias, k, n_group, topk_group, renormalize, scale):
    """The grouped choice token by token in float64: groups ranked by their two best biased
    scores, then the k best biased scores in the kept groups, weighed by their unbiased ones;
    equals ranked by the lower group or expert id."""
    t, e = logits.shape
    size = e // n_group
    s = torch.sigmoid(logits.double())
    out_w, out_ids = [], []
    for r in range(t):
        c = s[r] + bias.double()
        rank = sorted(range(n_group), key=lambda gi: (-float(c[gi * size:(gi + 1) * size].topk(2)[0].sum()), gi))
        allowed = [x for gi in rank[:topk_group] for x in range(gi * size, (gi + 1) * size)]
        chosen = sorted(allowed, key=lambda x: (-float(c[x]), x))[:k]
        w = s[r, chosen]
        if renormalize:
            w = w / w.sum()
        out_w.append(w * scale)
        out_ids.append(chosen)
    return torch.stack(out_w), torch.tensor(out_ids)


GROUPED = [topk_sigmoid_grouped, topk_sigmoid_grouped_ref]


@pytest.mark.parametrize("impl", GROUPED, ids=["triton", "torch"])
@pytest.mark.parametrize("n_group,topk_group,k", [(1, 1, 3), (4, 2, 3), (4, 1, 2), (2, 2, 4), (3, 2, 5)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_sigmoid_grouped(impl, n_group, topk_group, k, renormalize):
    """DeepSeek-V3's / Nemotron-H's choice against a float64 evaluation, largest first: the bias
    moves the choice (it is large against the scores' spread) but not the weights; shared slots
    weigh 1; groups of a size not a power of two (3 x 6) too."""
    t, e = 9, 18 if n_group == 3 else 16
    g = torch.Generator().manual_seed(n_group * 10 + k)
    logits = (torch.randn(t, e, generator=g) * 2).to(DEVICE)
    bias = (torch.randn(e, generator=g) * 0.5).to(DEVICE)
    for shared in (0, 2):
        want_w, want_ids = grouped_oracle(logits.cpu(), bias.cpu(), k, n_group, topk_group, renormalize, 2.5)
        weights, ids = impl(logits, bias, k, n_group, topk_group, renormalize, 2.5, torch.float32, shared=shared)
        assert ids.shape == weights.shape == (t, k + shared) and ids.dtype == torch.int64
        assert torch.equal(ids[:, :k].cpu(), want_ids)
        torch.testing.assert_close(weights[:, :k].cpu().double(), want_w, rtol=1e-6, atol=1e-7)
        assert torch.equal(ids[:, k:].cpu(), torch.arange(e, e + shared).expand(t, -1)) and (weights[:, k:] == 1).all()
    unbiased, plain_ids = impl(logits, None, k, n_group, topk_group, renormalize, 2.5, torch.float32)
    want_w, want_ids = grouped_oracle(logits.cpu(), torch.zeros(e), k, n_group, topk_group, renormalize, 2.5)
    assert torch.equal(plain_ids.cpu(), want_ids)
    torch.testing.assert_close(unbiased.cpu().double(), want_w, rtol=1e-6, atol=1e-7)
    assert not torch.equal(plain_ids.cpu(), ids[:, :k].cpu())  # the bias changed some token's choice
    with pytest.raises(ValueError, match="expert groups"):
        impl(logits, bias, k, 5, 1, renormalize, 1.0, torch.float32)
    with pytest.raises(ValueError, match="correction bias must be"):
        impl(logits, bias[:-1], k, n_group, topk_group, renormalize, 1.0, torch.float32)


@pytest.mark.parametrize("e,k,n_group,topk_group", [(16, 4, 1, 1), (24, 5, 4, 2), (128, 6, 1, 1), (64, 8, 8, 3)])
def test_topk_sigmoid_grouped_ties(e, k, n_group, topk_group):
    """Forced ties (logits of 3 values, biases of 2, so equal biased scores and equal group sums
    abound, while unequal ones differ by far more than rounding: no sigmoid(-x) + sigmoid(x) = 1
    pairs): the kernel, its torch reference and the float64 evaluation (Python's stable sort)
    agree exactly on the ids and their order, largest first and the lower id first among equals,
    groups likewise; with and without a bias, in float32 and bfloat16 (128 experts, 6 a token:
    Nemotron-3-Nano's router)."""
    t = 12
    g = torch.Generator().manual_seed(e + k)
    logits = torch.randint(0, 3, (t, e), generator=g).float().to(DEVICE)
    for bias in (None, (torch.randint(0, 2, (e,), generator=g) / 8).to(DEVICE)):
        want_w, want_ids = grouped_oracle(logits.cpu(), torch.zeros(e) if bias is None else bias.cpu(), k, n_group,
                                          topk_group, True, 2.5)
        for dtype in (torch.float32, torch.bfloat16):
            weights, ids = topk_sigmoid_grouped(logits, bias, k, n_group, topk_group, True, 2.5, dtype, shared=1)
            ref_w, ref_ids = topk_sigmoid_grouped_ref(logits, bias, k, n_group, topk_group, True, 2.5, dtype, shared=1)
            assert torch.equal(ids[:, :k].cpu(), want_ids) and torch.equal(ref_ids.cpu(), ids.cpu())
            assert weights.dtype == dtype
            tol = 1e-6 if dtype == torch.float32 else 1e-2  # (the interpreter truncates to bfloat16)
            torch.testing.assert_close(weights[:, :k].cpu().double(), want_w, rtol=tol, atol=tol / 10)
            torch.testing.assert_close(ref_w[:, :k].cpu().double(), want_w, rtol=tol, atol=tol / 10)


@pytest.mark.gpu
@pytest.mark.parametrize("e,k,n_group,topk_group,shared", [(128, 6, 1, 1, 2), (128, 6, 1, 1, 1), (256, 8, 8, 4, 1),
                                                           (512, 8, 1, 1, 0), (512, 10, 16, 4, 0)])
@pytest.mark.parametrize("t", [1, 7, 600])
def test_topk_sigmoid_grouped_gpu(e, k, n_group, topk_group, shared, t):
    """The kernel compiled, against its torch reference on the GPU: Nemotron-3-Nano's router (128
    experts, 6 a token, no groups, its shared expert as 2 slots at TP=1, 1 at TP=2), DeepSeek-V3's
    groups (256 in 8, 4 kept) and wider rows; logits distinct multiples of 1/64 (no near-ties for
    the two sigmoids' last bits to split), bfloat16 weights within their rounding."""
    g = torch.Generator().manual_seed(t + e)
    logits = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).sub(e / 2).div(64).cuda()
    bias = (torch.randint(-8, 9, (e,), generator=g) / 64).cuda()
    for b in (bias, None):
        weights, ids = topk_sigmoid_grouped(logits, b, k, n_group, topk_group, True, 2.5, torch.bfloat16, shared)
        ref_w, ref_ids = topk_sigmoid_grouped_ref(logits, b, k, n_group, topk_group, True, 2.5, torch.bfloat16, shared)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights.float(), ref_w.float(), rtol=8e-3, atol=1e-3)


def test_the_ungated_grouped_layer_with_a_shared_expert():
    """`FusedMoE` as Nemotron-H builds it (ungated relu^2 experts, the grouped sigmoid choice with
    a correction bias, a shared expert 1.5 experts wide kept as two slots, the second half
    padding) against transformers' formula in float64: the routed sum plus the shared MLP; the
    torch path (CPU) and the Triton kernels (under the interpreter on CPU) alike."""
    from workers.layers.moe import FusedMoE
    from workers.parallel import TPGroup
    e, k, h, inter, shared = 8, 3, 32, 16, 24
    layer = FusedMoE(e, k, h, inter, "relu2", TPGroup(), torch.float32, torch.device(DEVICE), "experts",
                     shared_intermediate=shared, scoring="sigmoid_grouped", gated=False, groups=(4, 2), scale=2.5)
    assert layer.shared_slots == 2 and tuple(layer.w13.shape) == (e + 2, inter, h)
    g = torch.Generator().manual_seed(12)
    up, down = torch.randn(e, inter, h, generator=g) * 0.3, torch.randn(e, h, inter, generator=g) * 0.3
    s_up, s_down = torch.randn(shared, h, generator=g) * 0.3, torch.randn(h, shared, generator=g) * 0.3
    with torch.no_grad():
        for x in range(e):  # one tensor each, as the published checkpoints keep them
            layer.weight_loader(layer.w13, up[x], (x, 0))
            layer.weight_loader(layer.w2, down[x], (x, None))
        layer.weight_loader(layer.w13, s_up, ("shared", 0))
        layer.weight_loader(layer.w2, s_down, ("shared", None))
    x = torch.randn(11, h, generator=g)
    logits, bias = torch.randn(11, e, generator=g), torch.randn(e, generator=g) * 0.3
    want_w, want_ids = grouped_oracle(logits, bias, k, 4, 2, True, 2.5)
    want = torch.zeros(11, h, dtype=torch.float64)
    for t in range(11):
        for j in range(k):
            ex = int(want_ids[t, j])
            want[t] += want_w[t, j] * (down[ex].double() @ torch.relu(up[ex].double() @ x[t].double()) ** 2)
        want[t] += s_down.double() @ torch.relu(s_up.double() @ x[t].double()) ** 2
    x, logits, bias = x.to(DEVICE), logits.to(DEVICE), bias.to(DEVICE)
    assert rel_err(layer(x, logits, bias).cpu(), want) < 1e-5
    weights, ids = topk_sigmoid_grouped(logits, bias, k, 4, 2, True, 2.5, torch.float32, shared=2)
    assert rel_err(fused_experts(x, layer.w13, layer.w2, weights, ids, relu2).cpu(), want) < 1e-5


@pytest.mark.parametrize("act", [silu_and_mul, relu2], ids=["silu-gated", "relu2"])
@pytest.mark.parametrize("t", [1, 5])
def test_activation_in_the_first_launch_equals_its_own_launch(act, t):
    """Decode-sized steps apply a known activation in the first GEMM's epilogue, rounding its
    inputs to x's dtype as the [R, 2I] buffer does; a function it does not know (here a wrapper)
    takes the activation launch: both give the same output (bf16, 16-row tiles)."""
    e, k, h, inter = 6, 2, 64, 48
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=g).to(DEVICE, torch.bfloat16)
    rows = 2 * inter if act is silu_and_mul else inter
    w13 = (torch.randn(e, rows, h, generator=g) / h ** 0.5).to(DEVICE, torch.bfloat16)
    w2 = (torch.randn(e, h, inter, generator=g) / inter ** 0.5).to(DEVICE, torch.bfloat16)
    b13 = (torch.randn(e, rows, generator=g) * 0.5).to(DEVICE, torch.bfloat16) if act is silu_and_mul else None
    weights, ids = routing(t, e, k, seed=t)
    fused = fused_experts(x, w13, w2, weights, ids, act, b13, config=SMALL)
    separate = fused_experts(x, w13, w2, weights, ids, lambda y: act(y), b13, config=SMALL)
    torch.testing.assert_close(fused, separate, rtol=1e-2, atol=1e-2)
    assert rel_err(fused.float().cpu(), separate.double().cpu()) < 1e-3


def test_the_engines_activations_are_the_ones_the_experts_kernel_applies_itself():
    """The layers pass `workers.ops`' activations: on a GPU the experts' kernel must see the
    kernels it can apply in its epilogue, not a wrapper it would take to the separate launch."""
    from kernels.activation import fusable
    from workers.ops import act_and_mul, ungated_act
    assert fusable(act_and_mul("silu").gpu) == (0, True)
    assert fusable(act_and_mul("gelu_pytorch_tanh").gpu) == (1, True)
    assert fusable(ungated_act("relu2").gpu) == (3, False)
