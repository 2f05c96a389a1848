"""Paged attention kernel against its torch reference (float64), and the reference against
torch SDPA on contiguous K/V. Inputs are fresh random each run; the output and every cache
element that holds no token (null block, blocks out of the window) are NaN, so an unwritten
output or a read of a block the kernel must skip fails."""
from __future__ import annotations

import math
import random

import pytest
import torch

from kernels.paged_attention import default_config, choose_num_splits, paged_attention
from kernels.paged_attention_ref import paged_attention_ref
from tests.conftest import DEVICE

# (context already cached, new query tokens): a fresh prefill, decodes, a prefix-continuing
# chunk, a one-token prompt.
MIXED = [(0, 19), (37, 1), (21, 9), (50, 1), (0, 1)]
DECODES = [(45, 1), (3, 1), (70, 1)]


def make_case(seqs, num_q_heads, num_kv_heads, head_dim, block_size, dtype, window=0, chunk=0, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else random.randrange(1 << 30))
    lens = [c + n for c, n in seqs]
    blocks_per_seq = [math.ceil(L / block_size) for L in lens]
    num_blocks = 1 + sum(blocks_per_seq) + 3
    kv = torch.full((num_blocks, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # shuffled, never block 0
    table = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32)
    for s, ((context, _), L) in enumerate(zip(seqs, lens)):
        first = 0  # first position any of the sequence's queries reads
        if window:
            first = max(0, context - window + 1)
        if chunk:
            first = context // chunk * chunk
        for b in range(blocks_per_seq[s]):
            if (b + 1) * block_size <= first:
                continue  # the null block stands in, as the manager leaves it
            table[s, b] = ids.pop()
        pos = torch.arange(first, L)
        blk, off = table[s, pos // block_size].long(), pos % block_size
        kv[blk, :, off] = torch.randn(len(pos), 2, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(n for _, n in seqs), num_q_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(torch.cumsum(torch.tensor([n for _, n in seqs]), 0)), dtype=torch.int32)
    args = dict(q=q.to(DEVICE), kv_cache=kv.to(DEVICE), block_table=table.to(DEVICE),
                query_start_loc=qsl.to(DEVICE), seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                max_query_len=max(n for _, n in seqs), max_seq_len=max(lens), scale=head_dim ** -0.5,
                sliding_window=window, chunk_size=chunk)
    return args, g


def check(args, tol=1e-2, **kw):
    ref_args = dict(args, q=args["q"].double(), kv_cache=args["kv_cache"].double())
    ref = paged_attention_ref(**ref_args, **{k: v for k, v in kw.items() if k not in ("config", "num_splits")})
    assert torch.isfinite(ref).all(), "the reference read a block it must skip"
    out = torch.full_like(args["q"], float("nan"))
    paged_attention(**args, out=out, **kw)
    assert torch.isfinite(out).all(), "unwritten output, or a skipped block was read"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.2e}"


def small(gqa):
    """Interpreter-sized tiles."""
    return {"BLOCK_M": max(16, 1 << (gqa - 1).bit_length()), "TILE_N": 16, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize("gqa, head_dim, dtype, window, chunk, softcap, sinks", [
    (1, 64, torch.bfloat16, 0, 0, 0.0, False),
    (4, 64, torch.float16, 0, 0, 0.0, False),
    (8, 64, torch.bfloat16, 0, 0, 0.0, False),
    (4, 128, torch.bfloat16, 5, 0, 0.0, False),   # window smaller than a block
    (4, 64, torch.float16, 20, 0, 0.0, False),    # window larger than a block
    (1, 64, torch.bfloat16, 20, 0, 50.0, False),  # Gemma-2: softcap 50
    (8, 64, torch.bfloat16, 0, 16, 0.0, False),   # Llama-4 local chunks
    (8, 64, torch.bfloat16, 7, 0, 0.0, True),     # gpt-oss: sinks + window
    (4, 256, torch.bfloat16, 0, 0, 30.0, True),
    (4, 128, torch.float16, 0, 16, 0.0, True),
    (4, 512, torch.bfloat16, 0, 0, 0.0, False),   # Gemma 4's full layers: head 512
    (8, 512, torch.float16, 12, 0, 0.0, False),
])
def test_mixed_batch_matches_reference(gqa, head_dim, dtype, window, chunk, softcap, sinks):
    args, g = make_case(MIXED, 2 * gqa, 2, head_dim, 8, dtype, window=window, chunk=chunk)
    kw = {"softcap": softcap, "config": small(gqa)}
    if sinks:
        kw["sinks"] = (torch.randn(2 * gqa, generator=g) * 2).to(DEVICE)
    check(args, **kw)


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
@pytest.mark.parametrize("window, sinks", [(0, False), (24, True)])
def test_split_kv_decode(splits, window, sinks):
    args, g = make_case(DECODES, 8, 2, 64, 16, torch.bfloat16, window=window)
    kw = {"config": small(4), "num_splits": splits}
    if sinks:
        kw["sinks"] = torch.randn(8, generator=g).to(DEVICE)
    check(args, **kw)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("chunk, softcap, head_scale", [(16, 0.0, False), (0, 30.0, True)])
def test_decode_with_local_chunks_softcap_and_head_scales(splits, chunk, softcap, head_scale):
    """A decode batch (the `DECODE` path) with Llama-4's local chunks, or a soft-cap and per-head
    scales."""
    args, g = make_case(DECODES + [(16, 1)], 8, 2, 64, 16, torch.bfloat16, chunk=chunk)
    kw = {"config": small(4), "num_splits": splits}
    if softcap:
        kw["softcap"] = softcap
    if head_scale:
        kw["head_scale"] = (torch.rand(8, generator=g) + 0.5).to(DEVICE)
    check(args, **kw)


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_batch_takes_the_decode_path_with_the_same_numbers(splits):
    """One token a sequence (max_query_len 1) maps program s to sequence s without looking the
    sequence up; given a bound of 2 the same batch takes the lookup, and the outputs are the same
    bits (padding sequences of no keys included: output 0)."""
    args, _ = make_case(DECODES + [(0, 1)], 8, 2, 64, 16, torch.bfloat16)
    args["seq_lens"][-1] = 0  # a CUDA graph's padding entry
    kw = {"config": small(4), "num_splits": splits}
    direct, looked_up = (paged_attention(**dict(args, max_query_len=m), **kw) for m in (1, 2))
    assert torch.equal(direct, looked_up)
    assert torch.equal(direct[-1], torch.zeros_like(direct[-1]))
    check(dict(args, q=args["q"][:-1], query_start_loc=args["query_start_loc"][:-1],
               seq_lens=args["seq_lens"][:-1]), **kw)


@pytest.mark.parametrize("block_size", [12, 44])
def test_block_size_not_a_power_of_two(block_size):
    """Mamba hybrids' blocks (176 tokens for Bamba-9B): tiles of keys span blocks or parts of one;
    the default configuration picks a power-of-two tile."""
    for max_query_len in (1, 40):
        assert default_config(max_query_len, 64, 4, block_size)["TILE_N"] & (default_config(
            max_query_len, 64, 4, block_size)["TILE_N"] - 1) == 0
    args, _ = make_case(MIXED, 8, 2, 64, block_size, torch.bfloat16)
    check(args, config=small(4))
    args, _ = make_case(DECODES, 8, 2, 64, block_size, torch.float16)
    check(args, config=small(4), num_splits=2)


def test_per_head_scale():
    args, g = make_case(MIXED, 8, 2, 64, 8, torch.bfloat16)
    check(args, head_scale=(torch.rand(8, generator=g) + 0.5).to(DEVICE), config=small(4))


def test_default_config_and_empty_batch():
    args, _ = make_case([(10, 1), (0, 5)], 4, 4, 64, 16, torch.float16)
    check(args)
    empty = dict(args, q=args["q"][:0], query_start_loc=torch.zeros(1, dtype=torch.int32, device=DEVICE),
                 seq_lens=args["seq_lens"][:0])
    assert paged_attention(**empty).shape == (0, 4, 64)


@pytest.mark.parametrize("block_size", [8, 64])
def test_head_512_with_the_default_tiles(block_size):
    """Head size 512 (Gemma 4's full layers) with the tiles the default configuration picks for
    it (tiles smaller than a block of 64), prefill and split decode."""
    for max_query_len in (1, 40):
        cfg = default_config(max_query_len, 512, 8, block_size)
        assert cfg["TILE_N"] == 32 and cfg["BLOCK_M"] <= 64 and cfg["num_stages"] <= 2
    args, _ = make_case(MIXED, 16, 2, 512, block_size, torch.bfloat16, window=20)
    check(args)
    args, _ = make_case(DECODES, 8, 1, 512, block_size, torch.float16)
    check(args, num_splits=2)


def test_bad_arguments():
    args, _ = make_case([(3, 2)], 6, 4, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(**args)
    args, _ = make_case([(3, 2)], 4, 4, 64, 16, torch.float16)
    with pytest.raises(ValueError, match="not both"):
        paged_attention(**dict(args, sliding_window=4, chunk_size=16))


def test_num_splits_choice():
    assert choose_num_splits(128, 8, 4096, 132) == 1  # enough programs already
    assert choose_num_splits(8, 8, 32768, 132) > 1
    assert choose_num_splits(1, 8, 64, 132) == 1  # too short to split
    assert choose_num_splits(1, 8, 640, 132) == 16  # short: one 64-key tile per split
    assert choose_num_splits(1, 8, 8192, 132) == 32  # long: up to ~2 waves of programs
    assert choose_num_splits(16, 8, 16384, 132) == 4
    # A window or a local chunk bounds the keys a query reads, whatever the graph's bound on the
    # context: 128 keys span at most two 128-key tiles.
    assert choose_num_splits(1, 8, 8192, 132, tile_n=128, sliding_window=128) == 2
    assert choose_num_splits(1, 8, 8192, 132, sliding_window=512) == 16
    assert choose_num_splits(1, 8, 8192, 132, chunk_size=8192) == 32
    assert choose_num_splits(1, 8, 640, 132, sliding_window=4096) == 16


def test_windowed_decode_under_a_long_bound_with_the_default_splits():
    """A CUDA graph's decode passes the model's length as the bound: a windowed layer's splits
    follow its window (one 128-key tile's worth here, where the bound alone gives 32 splits), and
    the outputs still match the reference."""
    args, _ = make_case(DECODES, 8, 2, 64, 16, torch.bfloat16, window=24)
    assert default_config(1, 64, 4, 16, sliding_window=24)["TILE_N"] == 128
    assert choose_num_splits(3, 2, 4096, 132, 128) == 32
    assert choose_num_splits(3, 2, 4096, 132, 128, sliding_window=24) == 1
    check(dict(args, max_seq_len=4096))


@pytest.mark.parametrize("window, chunk", [(0, 0), (6, 0), (0, 16)])
def test_reference_matches_sdpa_on_contiguous_kv(window, chunk):
    """The oracle itself, against torch SDPA with an explicit mask on the same data."""
    args, _ = make_case(MIXED, 8, 2, 64, 8, torch.float32, window=window, chunk=chunk)
    ref = paged_attention_ref(**dict(args, q=args["q"].double(), kv_cache=args["kv_cache"].double()))
    qsl, lens = args["query_start_loc"].tolist(), args["seq_lens"].tolist()
    for s, L in enumerate(lens):
        q = args["q"][qsl[s]:qsl[s + 1]].double()
        n = q.shape[0]
        pos = torch.arange(L, device=DEVICE)
        blocks, off = args["block_table"][s, pos // 8].long(), pos % 8
        k = args["kv_cache"][blocks, 0, off].double().nan_to_num()  # null positions are masked out
        v = args["kv_cache"][blocks, 1, off].double().nan_to_num()
        qpos = torch.arange(L - n, L, device=DEVICE)
        mask = pos[None, :] <= qpos[:, None]
        if window:
            mask &= pos[None, :] > qpos[:, None] - window
        if chunk:
            mask &= pos[None, :] >= qpos[:, None] // chunk * chunk
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(4, 0), v.transpose(0, 1).repeat_interleave(4, 0),
            attn_mask=mask, scale=args["scale"])
        torch.testing.assert_close(ref[qsl[s]:qsl[s + 1]], o.transpose(0, 1), rtol=1e-9, atol=1e-9)


@pytest.mark.gpu
def test_decode_step_replays_in_a_cuda_graph():
    """Fixed grid: a captured decode step replays correctly after seq_lens, block tables and
    queries change in place (the grid depends on the batch shape and num_splits only)."""
    args, g = make_case([(40, 1), (70, 1), (5, 1)], 8, 2, 128, 16, torch.bfloat16)
    for splits in (1, 4):
        static = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in args.items()}
        static["max_seq_len"] = 128  # a bound, as a captured step would pass
        out = torch.empty_like(static["q"])
        paged_attention(**static, out=out, num_splits=splits)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_attention(**static, out=out, num_splits=splits)
        # Next step: every sequence one token longer, new queries; the cache holds them already.
        static["seq_lens"].copy_(static["seq_lens"] - 1)
        static["q"].copy_(torch.randn(static["q"].shape, generator=g).to(static["q"]))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_ref(**dict(static, q=static["q"].double(), kv_cache=static["kv_cache"].double()))
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
