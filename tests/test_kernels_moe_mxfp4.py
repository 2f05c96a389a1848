"""The MXFP4 experts' kernels (`kernels/fused_moe_mxfp4.py`): the dequantization against
transformers' `convert_moe_packed_tensors` and the e2m1 formula, both ways of dequantizing in the
grouped GEMM (`tl.dot_scaled`, the integer decode) against a float64 loop over tokens and their
experts, and the GEMVs and tile GEMVs that small batches take (on CPU under TRITON_INTERPRET=1,
natively on a GPU)."""
from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import row_tiles, tokens_per_tile_band
import kernels.fused_moe_mxfp4 as mxfp4
from kernels.fused_moe_mxfp4 import (FP4_VALUES, GEMV_MAX_TOKENS, TILE_GEMV_MAX_ROWS, MXFP4Weight, SwigluOAI,
                                     _gemv_mxfp4, _grouped_gemm_mxfp4, _tile_gemv_mxfp4, _words, dequantize_mxfp4,
                                     fused_experts_mxfp4, fused_experts_mxfp4_ref, mxfp4_config,
                                     mxfp4_variant_tokens)
from tests.conftest import DEVICE
from tests.test_kernels_moe import rel_err, routing

ALPHA, LIMIT = 1.702, 1.5  # a limit that binds on these weights
ACT = SwigluOAI(ALPHA, LIMIT)
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
LARGE = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
TILE = {"TILE_GEMV": True, "BLOCK_M": 2, "BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2}  # two K steps at K = 96


def mxfp4_weight(e: int, n: int, k: int, seed: int, scales: tuple[int, int] = (120, 124)) -> MXFP4Weight:
    """Random bytes (every e2m1 value) and scales 2^(scales - 127)."""
    g = torch.Generator().manual_seed(seed)
    return MXFP4Weight(torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g).to(DEVICE),
                       torch.randint(*scales, (e, n, k // 32), dtype=torch.uint8, generator=g).to(DEVICE))


def oracle(x, w13: MXFP4Weight, w2: MXFP4Weight, weights, ids, b13, b2) -> torch.Tensor:
    """sum_j w[t, j] (W2 act(W13 x[t] + b13) + b2), all in float64, token by token; W13's rows
    (gate, up) pairs, gpt-oss's activation written out here."""
    w13f, w2f = (dequantize_mxfp4(w.blocks, w.scales, torch.float64) for w in (w13, w2))
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13f[e] @ x[t].double() + b13[e].double()
            gate, up = h[0::2].clamp(max=LIMIT), h[1::2].clamp(-LIMIT, LIMIT)
            h = gate * torch.sigmoid(ALPHA * gate) * (up + 1)
            out[t] += weights[t, j].double() * (w2f[e] @ h + b2[e].double())
    return out


def test_dequantize_is_transformers_and_the_e2m1_formula():
    """Every byte (both nibbles) under every finite E8M0 scale but 2^-127: transformers' table and
    nibble order, and value = (-1)^s 2^(e - 1) (1 + m / 2) (e > 0), m / 2 (e = 0), times 2^(scale - 127)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    blocks = torch.arange(256, dtype=torch.uint8).repeat(254).reshape(1, 254, 16, 16)
    scales = torch.arange(1, 255, dtype=torch.uint8)[None, :, None].expand(1, 254, 16).contiguous()
    ours = dequantize_mxfp4(blocks.flatten(2), scales, torch.float32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours, theirs)
    nib = torch.arange(16)
    s, e, m = nib >> 3, (nib >> 1) & 3, nib & 1
    values = (1 - 2 * s) * torch.where(e > 0, 2.0 ** (e - 1) * (1 + m / 2), m / 2)
    assert values.tolist() == list(FP4_VALUES)
    byte = torch.tensor([[[0x7A]]], dtype=torch.uint8)  # low nibble 0xA = -1 (even element), high 0x7 = 6
    assert dequantize_mxfp4(byte.expand(1, 1, 16).contiguous(), torch.tensor([[[128]]], dtype=torch.uint8))[
        0, 0, :2].tolist() == [-2.0, 12.0]


@pytest.mark.parametrize("dtype,scaled_dot", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, False)],
                         ids=["bf16-dot_scaled", "bf16-decode", "fp32-decode"])
@pytest.mark.parametrize("t,e,k,h,inter,cfg", [
    (1, 8, 2, 64, 32, SMALL),  # a decode step: every tile mostly padding
    (7, 6, 3, 96, 64, SMALL),  # H = 96: a partial K step (BLOCK_K 64) and masked N columns
    (37, 4, 2, 64, 96, LARGE),  # 64-row tiles, experts with many rows
    (GEMV_MAX_TOKENS + 32, 3, 2, 64, 32, None),  # past the GEMVs, the default tile rule (64-row tiles)
])
def test_fused_experts_mxfp4_against_a_float64_loop(dtype, scaled_dot, t, e, k, h, inter, cfg):
    g = torch.Generator().manual_seed(t + e)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w13, w2 = mxfp4_weight(e, 2 * inter, h, seed=e), mxfp4_weight(e, h, inter, seed=e + 1)
    weights, ids = routing(t, e, k, seed=t, skip=(0,))  # expert 0 unused: its weights never read
    w13.scales[0], w2.scales[0] = 255, 255  # (E8M0 NaN)
    b13 = (torch.randn(e, 2 * inter, generator=g) * 0.5).to(DEVICE, dtype)
    b2 = (torch.randn(e, h, generator=g) * 0.5).to(DEVICE, dtype)
    ref = oracle(x, w13, w2, weights, ids, b13, b2)
    got = fused_experts_mxfp4(x, w13, w2, weights.to(dtype), ids, ACT, b13, b2, config=cfg, scaled_dot=scaled_dot)
    assert got.shape == (t, h) and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    if scaled_dot:  # (once a shape) the torch reference, the engine's CPU path
        assert rel_err(fused_experts_mxfp4_ref(x, w13, w2, weights.to(dtype), ids, ACT, b13, b2), ref) < TOL[dtype]


@pytest.mark.parametrize("t", [6, 1], ids=["aligned", "one-token"])
@pytest.mark.parametrize("fused_act", [False, True], ids=["down", "gate_up"])
@pytest.mark.parametrize("way", ["dot_scaled", "decode", "tile"])
def test_grouped_gemm_writes_each_pair_row_once_and_nothing_else(way, fused_act, t):
    """One launch into a NaN-poisoned output whose rows are views of wider rows: the down GEMM
    (routing weights, a bias) or the gate/up GEMM with the activation of its (gate, up) row pairs
    fused (a bias, each token's row read for its k pairs): each pair's row is its expert's result,
    the columns beside it untouched. `tile`: the tile GEMVs on the same tiles of rows (2 a tile:
    experts with more pairs take several, padding rows in the rest), two K steps, a last program
    whose weight rows run past N."""
    e, k, kdim, n = 5, 2, 96, 40
    g = torch.Generator().manual_seed(7)
    a = torch.randn(t if fused_act else t * k, kdim, generator=g).to(DEVICE, torch.bfloat16)
    w = mxfp4_weight(e, n, kdim, seed=2)
    b = torch.randn(e, n, generator=g).to(DEVICE, torch.bfloat16)
    weights, ids = routing(t, e, k, seed=3)
    cfg = TILE if way == "tile" else SMALL
    tiles = row_tiles(ids, e, cfg["BLOCK_M"])
    cols = n // 2 if fused_act else n
    wide = torch.full((t * k, cols + 3), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    out = wide[:, :cols]
    routed, a_row_div, act = (None, k, ACT) if fused_act else (weights.reshape(-1), 1, None)
    if way == "tile":
        _tile_gemv_mxfp4(a, w, _words(w), b, tiles, out, routed, a_row_div, cfg, act)
    else:
        _grouped_gemm_mxfp4(a, w, b, tiles, out, routed, a_row_div, cfg, way == "dot_scaled", act)
    wf = dequantize_mxfp4(w.blocks, w.scales, torch.float64)
    flat = ids.flatten()
    for p in range(t * k):
        h = wf[flat[p]] @ a[p // k if fused_act else p].double() + b[flat[p]].double()
        if fused_act:
            gate, up = h[0::2].clamp(max=LIMIT), h[1::2].clamp(-LIMIT, LIMIT)
            want = gate * torch.sigmoid(ALPHA * gate) * (up + 1)
        else:
            want = h * weights.reshape(-1)[p].double()
        assert rel_err(out[p], want) < 1e-2, p
    assert torch.isnan(wide[:, cols:]).all(), "wrote outside the output rows"


@pytest.mark.parametrize("dtype, t, e, k, h, inter", [
    (torch.bfloat16, 1, 8, 2, 64, 32),  # a decode step
    (torch.float32, 1, 8, 2, 64, 32),
    (torch.bfloat16, 2, 6, 3, 96, 64),  # H = 96: a partial K step (BLOCK_K 128)
    (torch.float32, 2, 6, 3, 96, 64),
    (torch.bfloat16, 4, 5, 3, 64, 32),  # experts shared between tokens (12 pairs, 4 experts)
], ids=["bf16-decode", "fp32-decode", "bf16-partial-k", "fp32-partial-k", "bf16-shared-experts"])
def test_few_tokens_run_as_gemvs_against_a_float64_loop(dtype, t, e, k, h, inter, monkeypatch):
    """Up to GEMV_MAX_TOKENS tokens the op takes the GEMV path (every byte value, both nibbles,
    through the word decode), against the float64 loop; NaN scales of an expert no token chose
    are never read."""
    taken = []
    gemv_path = mxfp4._experts_gemv_mxfp4
    monkeypatch.setattr(mxfp4, "_experts_gemv_mxfp4", lambda *a: taken.append(1) or gemv_path(*a))
    g = torch.Generator().manual_seed(t + e)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w13, w2 = mxfp4_weight(e, 2 * inter, h, seed=e), mxfp4_weight(e, h, inter, seed=e + 1)
    weights, ids = routing(t, e, k, seed=t, skip=(0,))
    w13.scales[0], w2.scales[0] = 255, 255  # (E8M0 NaN)
    b13 = (torch.randn(e, 2 * inter, generator=g) * 0.5).to(DEVICE, dtype)
    b2 = (torch.randn(e, h, generator=g) * 0.5).to(DEVICE, dtype)
    got = fused_experts_mxfp4(x, w13, w2, weights.to(dtype), ids, ACT, b13, b2)
    assert taken and got.shape == (t, h) and got.dtype == dtype
    assert rel_err(got, oracle(x, w13, w2, weights, ids, b13, b2)) < TOL[dtype]


def test_each_batch_takes_its_path(monkeypatch):
    """Without a `config`: GEMV_MAX_TOKENS tokens take the GEMVs; one more, at most
    TILE_GEMV_MAX_ROWS pairs an expert, the tile GEMVs, up to the last batch within that; one more
    the grouped GEMMs; fp32 activations the grouped GEMMs past the GEMVs (paths recorded, not run).
    `mxfp4_variant_tokens` names a batch of each variant up to the tile GEMVs' last."""
    taken = []
    monkeypatch.setattr(mxfp4, "_experts_gemv_mxfp4", lambda x, *a: taken.append("gemv") or torch.zeros_like(x))
    monkeypatch.setattr(mxfp4, "_tile_gemv_mxfp4", lambda *a, **kw: taken.append("tile"))
    monkeypatch.setattr(mxfp4, "_grouped_gemm_mxfp4", lambda *a, **kw: taken.append("grouped"))
    e, k, h, inter = 24, 2, 64, 32
    w13, w2 = mxfp4_weight(e, 2 * inter, h, seed=5), mxfp4_weight(e, h, inter, seed=6)
    last_tile = TILE_GEMV_MAX_ROWS * e // k
    assert last_tile > GEMV_MAX_TOKENS
    for t, dtype in ((GEMV_MAX_TOKENS, torch.bfloat16), (GEMV_MAX_TOKENS + 1, torch.bfloat16),
                     (last_tile, torch.bfloat16), (last_tile + 1, torch.bfloat16),
                     (GEMV_MAX_TOKENS + 1, torch.float32)):
        weights, ids = routing(t, e, k, seed=t)
        out = fused_experts_mxfp4(torch.zeros(t, h, device=DEVICE, dtype=dtype), w13, w2, weights.to(dtype), ids,
                                  ACT)
        assert out.shape == (t, h)
    assert taken == ["gemv", "tile", "tile", "tile", "tile", "grouped", "grouped", "grouped", "grouped"]
    assert mxfp4_variant_tokens(e, k) == [1, 2, 3, 16, GEMV_MAX_TOKENS + 1]  # (gate/up rows 2 / 4 / 6 / 32, down 1 / 2)
    assert mxfp4_variant_tokens(e, k, itemsize=4) == [1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_tile_gemvs_against_a_float64_loop(dtype, monkeypatch):
    """Past GEMV_MAX_TOKENS, at most TILE_GEMV_MAX_ROWS pairs an expert, the op takes the tile
    GEMVs with its default tiles (one partial K step, H = 96; the down launch's second program
    past N) against the float64 loop: every byte value through the word decode, experts of one to
    several pairs; an expert no token chose has NaN scales, never read."""
    taken = []
    tile_path = mxfp4._tile_gemv_mxfp4
    monkeypatch.setattr(mxfp4, "_tile_gemv_mxfp4", lambda *a, **kw: taken.append(1) or tile_path(*a, **kw))
    t, e, k, h, inter = GEMV_MAX_TOKENS + 2, 20, 2, 96, 32
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w13, w2 = mxfp4_weight(e, 2 * inter, h, seed=8), mxfp4_weight(e, h, inter, seed=9)
    weights, ids = routing(t, e, k, seed=4, skip=(0,))
    w13.scales[0], w2.scales[0] = 255, 255  # (E8M0 NaN)
    b13 = (torch.randn(e, 2 * inter, generator=g) * 0.5).to(DEVICE, dtype)
    b2 = (torch.randn(e, h, generator=g) * 0.5).to(DEVICE, dtype)
    got = fused_experts_mxfp4(x, w13, w2, weights.to(dtype), ids, ACT, b13, b2)
    assert len(taken) == 2 and got.shape == (t, h) and got.dtype == dtype
    assert ids.flatten().bincount().max() > 2  # an expert of several tiles
    assert rel_err(got, oracle(x, w13, w2, weights, ids, b13, b2)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("cfg", [None, {"BLOCK_N": 8, "BLOCK_K": 32, "num_warps": 2},
                                 {"BLOCK_N": 16, "BLOCK_K": 64, "num_warps": 2}], ids=["default", "k_steps", "tails"])
@pytest.mark.parametrize("down", [False, True], ids=["gate_up", "down"])
def test_gemv_writes_each_output_row_once_and_nothing_else(down, cfg):
    """One GEMV launch into a NaN-poisoned output whose rows are views of wider rows: the gate/up
    launch (a row a pair, the activation of its (gate, up) pairs, each token's row read for its k
    pairs) or the down launch (a row a token, the sum over its k pairs times their routing
    weights, a bias): each row its value, the columns beside it untouched. Tiles: the default's
    one partial K step (K = 96, BLOCK_K 128); `k_steps` three K steps of 32; `tails` a K step of
    64, then a partial one, and a last program whose rows run past N (40 rows, 16 a program)."""
    t, e, k, kdim, n = 3, 5, 2, 96, 40
    g = torch.Generator().manual_seed(7)
    a = torch.randn(t * k if down else t, kdim, generator=g).to(DEVICE, torch.bfloat16)
    w = mxfp4_weight(e, n, kdim, seed=2)
    b = torch.randn(e, n, generator=g).to(DEVICE, torch.bfloat16)
    weights, ids = routing(t, e, k, seed=3)
    flat = ids.flatten().contiguous()
    rows, cols = (t, n) if down else (t * k, n // 2)
    wide = torch.full((rows, cols + 3), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    out = wide[:, :cols]
    if down:
        _gemv_mxfp4(a, w, _words(w), b, flat, out, weights.reshape(-1).contiguous(), k, 1, config=cfg)
    else:
        _gemv_mxfp4(a, w, _words(w), b, flat, out, None, 1, k, ACT, config=cfg)
    wf = dequantize_mxfp4(w.blocks, w.scales, torch.float64)
    for r in range(rows):
        if down:
            want = sum(weights.reshape(-1)[p].double() * (wf[flat[p]] @ a[p].double() + b[flat[p]].double())
                       for p in range(r * k, r * k + k))
        else:
            h = wf[flat[r]] @ a[r // k].double() + b[flat[r]].double()
            gate, up = h[0::2].clamp(max=LIMIT), h[1::2].clamp(-LIMIT, LIMIT)
            want = gate * torch.sigmoid(ALPHA * gate) * (up + 1)
        assert rel_err(out[r], want) < 1e-2, r
    assert torch.isnan(wide[:, cols:]).all(), "wrote outside the output rows"


def test_gemv_float16_products_clamp_activations_beyond_float16():
    """16-bit activations meet the weights as float16: values beyond +-65,504 (bf16 holds them)
    count as +-65,504, finite, not inf; the rest as float16 rounds them. A down launch of two
    pairs a token against the float64 loop on x so clamped, as GEMVs and as tile GEMVs; fp32
    activations keep their values."""
    t, e, k, kdim, n = 2, 4, 2, 64, 16
    g = torch.Generator().manual_seed(11)
    a = torch.randn(t * k, kdim, generator=g)
    a[0, 3], a[1, 40], a[3, 63] = 1.0e5, -3.0e6, 7.0e4
    w = mxfp4_weight(e, n, kdim, seed=4)
    weights, ids = routing(t, e, k, seed=5)
    flat, routed = ids.flatten().contiguous(), weights.reshape(-1).contiguous()
    wf = dequantize_mxfp4(w.blocks, w.scales, torch.float64)
    for dtype, limit in ((torch.bfloat16, 65504.0), (torch.float32, None)):
        x = a.to(DEVICE, dtype)
        out = torch.empty(t, n, device=DEVICE, dtype=dtype)
        _gemv_mxfp4(x, w, _words(w), None, flat, out, routed.to(dtype), k, 1)
        seen = x.double().clamp(-limit, limit) if limit else x.double()
        for r in range(t):
            want = sum(routed[p].to(dtype).double() * (wf[flat[p]] @ seen[p]) for p in range(r * k, r * k + k))
            assert torch.isfinite(out[r]).all() and rel_err(out[r], want) < (1e-2 if limit else 1e-5), (dtype, r)
    # The tile GEMVs round x the same way: each pair's row, before the sum over k.
    x, pairs = a.to(DEVICE, torch.bfloat16), torch.empty(t * k, n, device=DEVICE, dtype=torch.bfloat16)
    _tile_gemv_mxfp4(x, w, _words(w), None, row_tiles(ids, e, TILE["BLOCK_M"]), pairs, routed.bfloat16(), 1, TILE)
    for p in range(t * k):
        want = routed[p].bfloat16().double() * (wf[flat[p]] @ x[p].double().clamp(-65504.0, 65504.0))
        assert torch.isfinite(pairs[p]).all() and rel_err(pairs[p], want) < 1e-2, p


def test_gemv_float16_sums_stay_finite_at_the_largest_products():
    """Each float16 lane sums eight products before float32 takes over: at the largest weight
    (6, scale 2^0) and activation (65,504 after the clamp) a product is 6,141 (times 2^-6), and
    eight stay below 65,504 where sixteen would overflow to inf."""
    e, n, kdim = 2, 16, 64
    w = MXFP4Weight(torch.full((e, n, kdim // 2), 0x77, dtype=torch.uint8, device=DEVICE),
                    torch.full((e, n, kdim // 32), 127, dtype=torch.uint8, device=DEVICE))
    ids = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.full((1, kdim), 1.0e5 if dtype == torch.bfloat16 else 65504.0, device=DEVICE, dtype=dtype)
        out = torch.empty(1, n, device=DEVICE, dtype=torch.float32)  # (the sum is past float16)
        _gemv_mxfp4(x, w, _words(w), None, ids, out, None, 1, 1)
        want = torch.full((n,), 6.0 * 65504.0 * kdim, dtype=torch.float64, device=DEVICE)
        assert torch.isfinite(out).all() and rel_err(out[0], want) < 1e-2, dtype


def test_gemvs_read_activation_rows_off_word_boundaries():
    """16-bit activations are read as 16-byte vectors of words: rows that do not start on 16-byte
    boundaries (a view one element into wider rows) are copied first, and give the same result,
    in the GEMVs and in the tile GEMVs."""
    t, e, k, kdim, n = 2, 4, 2, 64, 16
    g = torch.Generator().manual_seed(12)
    wide = torch.randn(t * k, kdim + 8, generator=g).to(DEVICE, torch.bfloat16)
    w = mxfp4_weight(e, n, kdim, seed=6)
    weights, ids = routing(t, e, k, seed=7)
    flat, routed = ids.flatten().contiguous(), weights.reshape(-1).contiguous().bfloat16()
    got, want = (torch.empty(t, n, device=DEVICE, dtype=torch.float32) for _ in range(2))
    view = wide[:, 1:1 + kdim]
    assert view.data_ptr() % 16
    _gemv_mxfp4(view, w, _words(w), None, flat, got, routed, k, 1)
    _gemv_mxfp4(view.contiguous(), w, _words(w), None, flat, want, routed, k, 1)
    assert torch.equal(got, want)
    tiles = row_tiles(ids, e, TILE["BLOCK_M"])
    got, want = (torch.empty(t * k, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    _tile_gemv_mxfp4(view, w, _words(w), None, tiles, got, routed, 1, TILE)
    _tile_gemv_mxfp4(view.contiguous(), w, _words(w), None, tiles, want, routed, 1, TILE)
    assert torch.equal(got, want)


def test_blocks_off_word_boundaries_take_the_grouped_path():
    """Blocks whose rows do not start on 16-byte boundaries (a view into wider rows) cannot be read
    as words: the op takes the grouped GEMMs instead, with the same result."""
    e, k, h, inter = 4, 2, 64, 32
    wide = torch.randint(0, 256, (e, 2 * inter, h // 2 + 1), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(5)).to(DEVICE)
    w13 = MXFP4Weight(wide[:, :, 1:], mxfp4_weight(e, 2 * inter, h, seed=6).scales)  # rows of h/2 + 1 bytes
    w2 = mxfp4_weight(e, h, inter, seed=7)
    assert _words(w13) is None and _words(w2) is not None
    x = torch.randn(1, h, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    weights, ids = routing(1, e, k, seed=1)
    zeros13, zeros2 = torch.zeros(e, 2 * inter, device=DEVICE), torch.zeros(e, h, device=DEVICE)
    got = fused_experts_mxfp4(x, w13, w2, weights.bfloat16(), ids, ACT, zeros13.bfloat16(), zeros2.bfloat16())
    assert rel_err(got, oracle(x, w13, w2, weights, ids, zeros13, zeros2)) < TOL[torch.bfloat16]


def test_default_tiles_of_every_band_and_refusals():
    """The tiles `fused_experts_mxfp4` picks itself, one batch in each band (prefill's 128-row
    tiles included), against the float64 loop; bad weights refused."""
    e, k, h, inter = 4, 2, 64, 32
    w13, w2 = mxfp4_weight(e, 2 * inter, h, seed=5), mxfp4_weight(e, h, inter, seed=6)
    b13, b2 = torch.zeros(e, 2 * inter, device=DEVICE), torch.zeros(e, h, device=DEVICE)
    assert [mxfp4_config(t * k, e, tile_gemv=False)["BLOCK_M"] for t in tokens_per_tile_band(e, k)] == [16, 32, 64,
                                                                                                         128]
    assert [mxfp4_config(t * k, e, itemsize=4)["BLOCK_M"] for t in tokens_per_tile_band(e, k)] == [16, 32, 64, 64]
    assert mxfp4_config(TILE_GEMV_MAX_ROWS * e, e)["TILE_GEMV"] and "TILE_GEMV" not in mxfp4_config(
        TILE_GEMV_MAX_ROWS * e + 1, e)
    for t in tokens_per_tile_band(e, k)[::3]:
        x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(DEVICE, torch.bfloat16)
        weights, ids = routing(t, e, k, seed=t)
        out = fused_experts_mxfp4(x, w13, w2, weights.bfloat16(), ids, ACT, b13.bfloat16(), b2.bfloat16())
        assert rel_err(out, oracle(x, w13, w2, weights, ids, b13, b2)) < TOL[torch.bfloat16], t
    with pytest.raises(TypeError, match="uint8"):
        MXFP4Weight(w13.blocks.to(torch.int16), w13.scales)
    with pytest.raises(ValueError, match="do not fit"):
        MXFP4Weight(w13.blocks, w13.scales[:, :, :1])
    x = torch.zeros(3, h, device=DEVICE)
    weights, ids = routing(3, e, k, seed=0)
    with pytest.raises(ValueError, match="expert shapes do not fit"):
        fused_experts_mxfp4(x, w2, w13, weights, ids, ACT)
    with pytest.raises(TypeError, match="dot_scaled takes bf16"):
        fused_experts_mxfp4(x, w13, w2, weights, ids, ACT, scaled_dot=True)
    with pytest.raises(TypeError, match="tile GEMVs take 16-bit"):
        fused_experts_mxfp4(x, w13, w2, weights, ids, ACT, config=TILE)
    off_words = MXFP4Weight(torch.zeros(e, 2 * inter, h // 2 + 1, dtype=torch.uint8, device=DEVICE)[:, :, 1:],
                            w13.scales)
    with pytest.raises(ValueError, match="16-byte boundaries"):
        fused_experts_mxfp4(x.bfloat16(), off_words, w2, weights.bfloat16(), ids, ACT, config=TILE)


@pytest.mark.gpu
@pytest.mark.parametrize("scaled_dot", [True, False], ids=["dot_scaled", "decode"])
def test_gpt_oss_widths_against_the_bf16_op(scaled_dot):
    """gpt-oss's widths (H = I = 2880: a partial 128-wide K step) with the tiles of every band,
    the GEMVs of 1 and GEMV_MAX_TOKENS tokens and the tile GEMVs (their default tiles, forced at
    one token more), against `fused_experts` on the same weights dequantized to bf16."""
    from kernels.activation import swiglu_oai_and_mul
    from kernels.fused_moe import fused_experts
    e, k, h, inter = 8, 4, 2880, 2880
    w13, w2 = mxfp4_weight(e, 2 * inter, h, seed=0, scales=(119, 122)), mxfp4_weight(e, h, inter, seed=1,
                                                                                      scales=(119, 122))
    g = torch.Generator().manual_seed(2)
    b13, b2 = (torch.randn(e, n, generator=g).to(DEVICE, torch.bfloat16) * 0.1 for n in (2 * inter, h))
    dense13, dense2 = (dequantize_mxfp4(w.blocks, w.scales, torch.bfloat16) for w in (w13, w2))
    halves = lambda t: torch.cat([t[:, 0::2], t[:, 1::2]], 1).contiguous()  # noqa: E731 (the bf16 op's layout)
    act = lambda h: swiglu_oai_and_mul(h, ALPHA, LIMIT)  # noqa: E731
    # the GEMVs at their fewest and most tokens, then each band's tiles (forced where GEMVs would run)
    tile = mxfp4_config(TILE_GEMV_MAX_ROWS * e, e)
    cases = [(1, None), (GEMV_MAX_TOKENS, None), (GEMV_MAX_TOKENS + 1, tile),
             *((t, mxfp4_config(t * k, e, tile_gemv=False)) for t in tokens_per_tile_band(e, k))]
    for t, cfg in cases:
        x = torch.randn(t, h, generator=g).to(DEVICE, torch.bfloat16)
        weights, ids = routing(t, e, k, seed=t)
        want = fused_experts(x, halves(dense13), dense2, weights.bfloat16(), ids, act, halves(b13), b2)
        got = fused_experts_mxfp4(x, w13, w2, weights.bfloat16(), ids, ACT, b13, b2, config=cfg,
                                  scaled_dot=scaled_dot)
        assert rel_err(got, want.double()) < 1e-2, (t, cfg)


@pytest.mark.gpu
def test_tile_gemvs_in_a_cuda_graph_equal_eager():
    """gpt-oss's widths at a batch the rule gives the tile GEMVs (the alignment launch, both tile
    launches and the sum captured in a CUDA graph): replays equal the eager op bit for bit, and
    the grouped GEMMs' result within bf16's rounding."""
    e, k, h, inter, t = 64, 4, 2880, 2880, GEMV_MAX_TOKENS + 1
    assert mxfp4_config(t * k, e).get("TILE_GEMV")
    w13, w2 = mxfp4_weight(e, 2 * inter, h, seed=3, scales=(119, 122)), mxfp4_weight(e, h, inter, seed=4,
                                                                                      scales=(119, 122))
    g = torch.Generator().manual_seed(5)
    b13, b2 = (torch.randn(e, n, generator=g).to(DEVICE, torch.bfloat16) * 0.1 for n in (2 * inter, h))
    x = torch.randn(t, h, generator=g).to(DEVICE, torch.bfloat16)
    weights, ids = routing(t, e, k, seed=6)
    run = lambda: fused_experts_mxfp4(x, w13, w2, weights.bfloat16(), ids, ACT, b13, b2)  # noqa: E731
    eager = run()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = run()
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    grouped = fused_experts_mxfp4(x, w13, w2, weights.bfloat16(), ids, ACT, b13, b2,
                                  config=mxfp4_config(t * k, e, tile_gemv=False))
    assert rel_err(eager, grouped.double()) < 1e-2
