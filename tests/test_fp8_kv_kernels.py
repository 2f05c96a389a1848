"""The fp8 (e4m3) KV cache in the kernels: the store kernel's x / scale (saturated at +-448) and
the paged attention kernel's e4m3 x scale reads, against float64 references.

Triton's CPU interpreter (3.9) reads e4m3 exactly (every finite byte; it takes the two NaN bytes
for +-480), but its float -> e4m3 conversion rounds wrongly (a mantissa carry is lost: 31.6 ->
16, and ties go away from zero). So on CPU the store kernel is checked on values that need no
rounding (exact multiples of the scale, and saturated ones); its rounding on random values is a
`gpu` test. The attention kernel reads only, and is checked here in every mode."""
from __future__ import annotations

import pytest
import torch

from kernels.kv_store import FP8_DTYPE, FP8_MAX, quantize_fp8_ref, store_kv, store_kv_ref, value_group, values_view
from kernels.paged_attention import _num_sms, batch_fills_gpu, default_config, paged_attention
from kernels.paged_attention_ref import paged_attention_ref
from tests.conftest import DEVICE
from tests.test_paged_attention import DECODES, MIXED, make_case, small


def _scales(g) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = (torch.rand(2, generator=g) * 0.2 + 0.05).tolist()
    return (torch.tensor([k], device=DEVICE), torch.tensor([v], device=DEVICE))


def usual_order(cache: torch.Tensor) -> torch.Tensor:
    """An fp8 cache in float64 with its values back in the usual [slot, head, dim] order
    (`kernels.kv_store.value_group`)."""
    nb, _, bs, h, d = cache.shape
    out = cache.view(torch.uint8).view(FP8_DTYPE).double()
    out[:, 1] = values_view(cache).permute(0, 1, 4, 2, 3).reshape(nb, bs, h, d).view(FP8_DTYPE).double()
    return out


def fp8_case(seqs, num_q_heads, num_kv_heads, head_dim, block_size, dtype, **kw):
    """`make_case`'s inputs with the cache in e4m3 (its NaN poison stays NaN), values in their
    groups, and its scales."""
    args, g = make_case(seqs, num_q_heads, num_kv_heads, head_dim, block_size, dtype, **kw)
    k_scale, v_scale = _scales(g)
    kv = args["kv_cache"].float() * 3.0  # spread over e4m3's exponents
    nb, _, bs, h, d = kv.shape
    fp8 = torch.empty(kv.shape, dtype=FP8_DTYPE, device=DEVICE)
    fp8[:, 0] = quantize_fp8_ref(kv[:, 0], k_scale)
    gs = value_group(fp8)
    values = quantize_fp8_ref(kv[:, 1], v_scale).view(torch.uint8)
    values_view(fp8)[:] = values.view(nb, bs // gs, gs, h, d).permute(0, 1, 3, 4, 2)
    return dict(args, kv_cache=fp8, k_scale=k_scale, v_scale=v_scale), g


def dequantized(args) -> dict:
    """The same inputs in float64, the cache read as e4m3 x scale in the usual order: the oracle's,
    with no fp8 path."""
    kv = usual_order(args["kv_cache"])
    kv[:, 0] *= args["k_scale"].double()
    kv[:, 1] *= args["v_scale"].double()
    return {**{k: v for k, v in args.items() if k not in ("k_scale", "v_scale")}, "q": args["q"].double(),
            "kv_cache": kv}


def check_fp8(args, tol=1e-2, **kw):
    ref = paged_attention_ref(**dequantized(args), **{k: v for k, v in kw.items() if k not in ("config", "num_splits")})
    assert torch.isfinite(ref).all(), "the reference read a block it must skip"
    # The reference's own fp8 path (what the engine runs on CPU) reads the same values.
    got_ref = paged_attention_ref(**dict(args, q=args["q"].double()),
                                  **{k: v for k, v in kw.items() if k not in ("config", "num_splits")})
    torch.testing.assert_close(got_ref, ref, rtol=1e-12, atol=1e-12)
    out = torch.full_like(args["q"], float("nan"))
    paged_attention(**args, out=out, **kw)
    assert torch.isfinite(out).all(), "unwritten output, or a skipped block was read"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("gqa, head_dim, dtype, window, chunk, softcap, sinks, block, tile", [
    (4, 64, torch.bfloat16, 0, 0, 0.0, False, 8, 16),     # blocks of 8: values in the usual order
    (4, 64, torch.bfloat16, 0, 0, 0.0, False, 16, 32),    # values in groups of 16, e4m3 products
    (4, 64, torch.float16, 0, 0, 0.0, False, 16, 16),     # 16-key tiles: products in the query's dtype
    (4, 64, torch.float16, 20, 0, 0.0, False, 16, 32),    # sliding window
    (1, 64, torch.bfloat16, 20, 0, 50.0, False, 32, 32),  # softcap; blocks of 32
    (8, 64, torch.bfloat16, 0, 16, 0.0, False, 48, 32),   # local chunks; blocks of three groups
    (8, 64, torch.bfloat16, 7, 0, 0.0, True, 16, 32),     # sinks + window
    (4, 128, torch.float32, 0, 0, 30.0, True, 24, 32),    # fp32 queries (ieee products); usual order
])
def test_fp8_cache_mixed_batch_matches_float64_reference(gqa, head_dim, dtype, window, chunk, softcap, sinks, block,
                                                         tile):
    """Prefills, decodes and prefix-continuing chunks in one launch; the slots outside each
    sequence's range are NaN."""
    args, g = fp8_case(MIXED, 2 * gqa, 2, head_dim, block, dtype, window=window, chunk=chunk)
    kw = {"softcap": softcap, "config": dict(small(gqa), TILE_N=tile)}
    if sinks:
        kw["sinks"] = (torch.randn(2 * gqa, generator=g) * 2).to(DEVICE)
    check_fp8(args, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, window", [(torch.bfloat16, 0), (torch.float16, 0), (torch.bfloat16, 100)])
def test_fp8_prefill_default_tiles_match_float64_reference(dtype, window):
    """Prefills at their default tiles, the products in e4m3 on the GPU's warpgroup MMA: the
    interpreter runs this code on small tiles only, which compile to other instructions."""
    args, _ = fp8_case([(0, 300), (200, 77), (0, 1), (33, 64)], 16, 8, 256, 16, dtype, window=window)
    check_fp8(args, tol=5e-3)


@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_cache_split_decode(splits):
    """Flash-decoding splits: v_scale applied to each split's partial sums before the merge."""
    args, g = fp8_case(DECODES, 8, 2, 64, 16, torch.bfloat16, window=24)
    check_fp8(args, config=small(4), num_splits=splits, sinks=torch.randn(8, generator=g).to(DEVICE))


@pytest.mark.parametrize("fills, gqa, warps", [(True, 2, 1), (False, 2, 4), (True, 8, 4)])
def test_fp8_decode_default_tiles_match_float64_reference(fills, gqa, warps):
    """The decode tiles an e4m3 cache gets by default at D=128: 1-warp programs for batches with a
    program for every SM, 4 warps for smaller (split) batches and for GQA 8."""
    sms = _num_sms(torch.device(DEVICE))
    num_seqs = -(-sms // 2) if fills else 1  # 2 KV heads: a program a sequence and head
    lens = [(17 + 29 * i % 90, 1) for i in range(num_seqs)]
    args, _ = fp8_case(lens, 2 * gqa, 2, 128, 16, torch.bfloat16)
    assert batch_fills_gpu(num_seqs, 2, sms) == fills
    assert default_config(1, 128, gqa, 16, fp8=True, fills_gpu=fills)["num_warps"] == warps
    check_fp8(args)


def test_fp8_scales_are_required_and_checked():
    args, _ = fp8_case([(3, 2)], 4, 2, 64, 16, torch.float16)
    for bad in (dict(k_scale=None), dict(v_scale=args["v_scale"].double()), dict(k_scale=torch.ones(2, device=DEVICE))):
        with pytest.raises(ValueError, match="fp8 KV cache needs"):
            paged_attention(**dict(args, **bad))
        with pytest.raises(ValueError, match="fp8 KV cache needs"):
            paged_attention_ref(**dict(args, **bad))
    plain, _ = make_case([(3, 2)], 4, 2, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="apply to an fp8 KV cache"):
        paged_attention(**plain, k_scale=args["k_scale"], v_scale=args["v_scale"])


def _store_inputs(n, heads, dim, dtype, k_scale, v_scale, g, exact: bool):
    """K and V for n tokens; `exact`: e4m3 values times the scale (no rounding needed), a few
    beyond +-448 x scale (saturated)."""
    if exact:
        codes = torch.randint(0, 256, (2, n, heads, dim), generator=g, dtype=torch.int32).to(torch.uint8)
        vals = codes.view(FP8_DTYPE).float().nan_to_num(0.0)  # (the two NaN codes)
        k, v = vals[0] * k_scale, vals[1] * v_scale
        k[0, 0, :4] = torch.tensor([1e4, -1e4, 500.0, -460.0]) * k_scale
        v[-1, -1, :2] = torch.tensor([-1e5, 449.0]) * v_scale
    else:
        k, v = (torch.randn(2, n, heads, dim, generator=g) * torch.exp(torch.randn(2, n, heads, 1, generator=g) * 2))
    return k.to(dtype), v.to(dtype)


def _store_case(exact: bool, dtype=torch.bfloat16, seed=0, block=8):
    """Blocks of 8 keep the values in the usual order, of 16 in their groups."""
    g = torch.Generator().manual_seed(seed)
    n, heads, dim, num_blocks = 13, 2, 64, 6
    # Power-of-two scales for `exact` (x / scale exact in every dtype), any for rounding.
    k_scale, v_scale = (0.125, 2.0) if exact else tuple((torch.rand(2, generator=g) + 0.05).tolist())
    k, v = _store_inputs(n, heads, dim, dtype, k_scale, v_scale, g, exact)
    slots = torch.randperm((num_blocks - 1) * block, generator=g)[:n] + block  # never block 0
    slots[3] = -1  # a prefix hit: not written
    scales = (torch.tensor([k_scale], device=DEVICE), torch.tensor([v_scale], device=DEVICE))
    return k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE), scales, (num_blocks, 2, block, heads, dim)


def _stored(fn, k, v, slots, scales, shape) -> torch.Tensor:
    cache = torch.full(shape, float("nan"), device=DEVICE).to(FP8_DTYPE)
    fn(k, v, cache, slots, *scales)
    return cache.view(torch.uint8).cpu()


@pytest.mark.parametrize("block", [8, 16])
def test_store_ref_quantizes_saturates_and_skips_hits(block):
    k, v, slots, scales, shape = _store_case(exact=False, dtype=torch.float32, block=block)
    got = usual_order(_stored(store_kv_ref, k, v, slots, scales, shape).view(FP8_DTYPE))
    k, v, scales = k.cpu(), v.cpu(), [s.cpu() for s in scales]  # `_stored` hands the cache back on the CPU
    for t, s in enumerate(slots.tolist()):
        blk, off = divmod(s, shape[2])
        if s < 0:
            continue
        for j, (x, scale) in enumerate(((k, scales[0]), (v, scales[1]))):
            want = (x[t].double() / scale.double()).clamp(-FP8_MAX, FP8_MAX)
            err = (got[blk, j, off].double() - want).abs()
            # Rounded to nearest: within half a step of e4m3 (3 mantissa bits; 2^-9 below 2^-6).
            step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0 ** -6))) - 3)
            assert (err <= step / 2 + 1e-12).all()
    written = {divmod(s, shape[2]) for s in slots.tolist() if s >= 0}
    cache = got.view(-1, 2, shape[2], shape[3], shape[4])
    unwritten = [cache[b, :, o] for b in range(shape[0]) for o in range(shape[2]) if (b, o) not in written]
    assert all(u.isnan().all() for u in unwritten), "a slot of -1 (or an unlisted one) was written"


@pytest.mark.parametrize("block", [8, 16])
def test_store_kernel_scales_and_saturates_like_the_reference(block):
    """Values that need no rounding (see the module's note): the kernel's division by the scale,
    its saturation and its slots, byte for byte."""
    k, v, slots, scales, shape = _store_case(exact=True, block=block)
    torch.testing.assert_close(_stored(store_kv, k, v, slots, scales, shape),
                               _stored(store_kv_ref, k, v, slots, scales, shape), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_kernel_rounds_like_the_reference(dtype):
    """Random values over many exponents, random scales: the same e4m3 bytes (round to nearest
    even, div_rn) as the torch reference."""
    k, v, slots, scales, shape = _store_case(exact=False, dtype=dtype, seed=3, block=16)
    torch.testing.assert_close(_stored(store_kv, k, v, slots, scales, shape),
                               _stored(store_kv_ref, k, v, slots, scales, shape), rtol=0, atol=0)


@pytest.mark.gpu
def test_fp8_store_and_decode_replay_in_a_cuda_graph():
    """A decode step (store the new token's K/V, attend) captured with an fp8 cache and its scales
    as device tensors; replayed after the queries, keys, seq_lens and the scales' values change in
    place, it matches the float64 reference on the dequantized cache."""
    args, g = fp8_case([(40, 1), (70, 1), (5, 1)], 8, 2, 128, 16, torch.bfloat16)
    static = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in args.items()}
    static["max_seq_len"] = 128
    n = static["q"].shape[0]
    new_k = torch.randn(n, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    new_v = torch.randn(n, 2, 128, device=DEVICE, dtype=torch.bfloat16)
    lens = static["seq_lens"].long()
    slots = (static["block_table"][torch.arange(n, device=DEVICE), (lens - 1) // 16].long() * 16 + (lens - 1) % 16)
    for splits in (1, 4):
        out = torch.empty_like(static["q"])

        def step():
            store_kv(new_k, new_v, static["kv_cache"], slots, static["k_scale"], static["v_scale"])
            paged_attention(**static, out=out, num_splits=splits)
        step()  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        static["q"].copy_(torch.randn(static["q"].shape, generator=g).to(static["q"]))
        new_k.copy_(torch.randn(new_k.shape, device=DEVICE))
        static["k_scale"].fill_(0.09)
        static["v_scale"].fill_(0.03)
        graph.replay()
        torch.cuda.synchronize()
        expect = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in static.items()}
        store_kv_ref(new_k, new_v, expect["kv_cache"], slots, expect["k_scale"], expect["v_scale"])
        assert torch.equal(expect["kv_cache"].view(torch.uint8), static["kv_cache"].view(torch.uint8))
        ref = paged_attention_ref(**dequantized(expect))
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
