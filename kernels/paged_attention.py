"""Paged attention over the shared group buffers: one launch for a mixed batch.

One program computes BLOCK_Q query tokens of one sequence for all the query heads that share one
KV head (GQA packing: BLOCK_M = BLOCK_Q x heads-per-KV-head rows), so both products are `tl.dot`
and every K/V tile is read once for all of them. Keys are walked in tiles of TILE_N positions
through the sequence's block table, from the first position any of the program's queries reads
(the sliding window's or the local chunk's start: the cost grows with the window, not the
context) to the last one (causal). Loads outside that range are masked, so the null block and
blocks that left the window are never read.

Decode batches too small to fill the GPU split each sequence's key range into NUM_SPLITS parts
(flash-decoding); a merge kernel combines the partial softmax states. The grid depends only on
(num_tokens, num_seqs, num_splits), never on data: a decode step can be captured in a CUDA graph
when the caller fixes `num_splits` (or passes a fixed bound as `max_seq_len`).

Options: sliding window (a query at p reads p-W+1..p), chunked local attention (keys of the
query's chunk p // C), logit soft-capping, a scale (and optional per-head factors), attention
sinks (a per-head logit in the softmax denominator, gpt-oss). fp32 accumulation; bf16/fp16 in
and out.

An fp8 cache (e4m3, `kernels.kv_store`, its values in groups of 16 slots) is converted to the
query's dtype in registers (exactly: every e4m3 value is a bf16 and an fp16 one), except where
prefills multiply P x V in e4m3 (`_attend_tile`); its scales are folded in where they cost
nothing: k_scale into the logits' scale, v_scale into the output.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels.kv_store import VALUE_GROUP, check_scales, is_fp8, value_group, value_offsets
from kernels.pdl import pdl_args, pdl_wait

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid_q, BLOCK_Q: tl.constexpr):
    """Sequence of global q-block `pid_q`: the q blocks of sequence s start at
    query_start_loc[s] // BLOCK_Q + s (an upper bound that keeps the grid data-independent)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= pid_q:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_tile(q, m_i, l_i, acc, tile, kv_lo, kv_hi, pos, bt_row, k_ptr, v_ptr, kv_head, dims, dim_ok, scale, qk_scale,
                 softcap, row_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                 SLIDING_WINDOW: tl.constexpr, CHUNK: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                 HAS_HEAD_SCALE: tl.constexpr, FP8: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
                 GROUPED: tl.constexpr, FP8_PV: tl.constexpr, INTERPRET: tl.constexpr, EDGE: tl.constexpr,
                 V_FIRST: tl.constexpr):
    """One key tile's scores, softmax update and values: the running (m_i, l_i, acc) after keys
    [tile * TILE_N, + TILE_N) of [kv_lo, kv_hi). GROUPED: an fp8 cache's values in their groups
    (`kernels.kv_store.value_group`). V_FIRST: the values (ungrouped) loaded with the keys, before
    the scores: a split decode program walks a tile or two, so its loads are not pipelined, and
    the values' load waited for the scores."""
    offs = tile * TILE_N + tl.arange(0, TILE_N)
    key_ok = (offs >= kv_lo) & (offs < kv_hi)
    block = tl.load(bt_row + offs // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    if GROUPED:  # each value group's first key and its block (none for a group out of the range)
        gkey = tile * TILE_N + tl.arange(0, TILE_N // VALUE_GROUP) * VALUE_GROUP
        g_ok = (gkey + VALUE_GROUP > kv_lo) & (gkey < kv_hi)
        gblock = tl.load(bt_row + gkey // BLOCK_SIZE, mask=g_ok, other=0).to(tl.int64)
    slot = offs % BLOCK_SIZE
    if V_FIRST and not GROUPED:
        v_early = tl.load(v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh
                          + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    k = tl.load(k_ptr + block[None, :] * stride_kb + slot[None, :] * stride_kt + kv_head * stride_kh
                + dims[:, None], mask=key_ok[None, :] & dim_ok[:, None], other=0.0)
    if FP8:
        k = k.to(q.dtype)
    if DOT_F32:
        k = k.to(tl.float32)
    s = tl.dot(q, k, input_precision=PRECISION)  # [BLOCK_M, TILE_N], fp32
    if USE_SOFTCAP:
        x = s * (scale / softcap)
        if HAS_HEAD_SCALE:
            x = x * row_scale[:, None]
        # softcap * tanh(x), tanh through exp2 (stable for both signs)
        e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        s = tl.where(x < 0, -t, t) * (softcap * 1.4426950408889634)
    else:
        s = s * qk_scale
        if HAS_HEAD_SCALE:
            s = s * row_scale[:, None]
    visible = key_ok[None, :] & (offs[None, :] <= pos[:, None])
    if SLIDING_WINDOW > 0:
        visible = visible & (offs[None, :] > pos[:, None] - SLIDING_WINDOW)
    if CHUNK > 0:
        visible = visible & (offs[None, :] >= (pos[:, None] // CHUNK) * CHUNK)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    if FP8_PV:  # p (and so acc and l_i) x 256: see below
        p = tl.exp2(s - (m_safe - 8.0)[:, None])
    else:
        p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if GROUPED:
        # [HEAD_DIM_PAD, TILE_N] loaded as [dims, groups, VALUE_GROUP], 16 keys side by side. A group
        # is read whole (a mask per key loads byte by byte), so the first and last group may bring
        # slots out of [kv_lo, kv_hi): their p is 0, but the bytes may be anything, NaN included
        # (a page that held another layer type's state), and 0 x NaN is NaN: made finite below.
        j = tl.arange(0, VALUE_GROUP)
        gs = (gkey % BLOCK_SIZE)[None, :, None] + j[None, None, :]
        at = (v_ptr + gblock[None, :, None] * stride_vb
              + value_offsets(gs, kv_head, dims[:, None, None], stride_vt, stride_vh, True))
        vt = tl.load(at, mask=dim_ok[:, None, None] & g_ok[None, :, None], other=0.0)
        if FP8_PV and EDGE:
            # Only a first or last tile's groups straddle kv_lo or kv_hi: the others skip the select.
            key = gkey[None, :, None] + j[None, None, :]
            keep = (key >= kv_lo) & (key < kv_hi)
            vt = tl.where(keep, vt.to(tl.uint8, bitcast=True), 0).to(vt.dtype, bitcast=True)
        v = tl.trans(tl.reshape(vt, [HEAD_DIM_PAD, TILE_N]))
    elif V_FIRST:
        v = v_early
    else:
        v = tl.load(v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh
                    + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
    if FP8_PV:
        # The product in e4m3: twice the bf16 rate, and V reaches shared memory as stored, keys
        # side by side as the fp8 product wants (a bf16 V would be stored there one value at a
        # time). p in two e4m3 terms: hi, its fp16 value cut to e4m3's 3 mantissa bits (exact),
        # and lo, the rest rounded; about 7 bits of p, near bf16's 8. p is scaled by 256 (acc and
        # l_i with it: the output is unchanged) to keep values down to 2^-18 out of e4m3's
        # subnormals. Both terms are >= 0 on purpose: with hi rounded to nearest, lo takes
        # either sign, and the products came out wrong on the H200 at the wgmma tiles (Triton
        # 3.6: relative error 0.8 to 5 where 2e-3 is right; not isolated further).
        p16 = p.to(tl.float16)
        hi16 = (p16.to(tl.int16, bitcast=True) & -128).to(tl.float16, bitcast=True)
        hi = hi16.to(v.dtype)
        lo = (p16 - hi16).to(v.dtype)
        if INTERPRET:  # the interpreter multiplies e4m3 as bytes: the same values in fp32
            hi, lo, v = hi.to(tl.float32), lo.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None]
        acc = tl.dot(hi, v, acc, input_precision=PRECISION)
        acc = tl.dot(lo, v, acc, input_precision=PRECISION)
    else:
        if FP8:
            v = v.to(q.dtype)
        if GROUPED:
            if INTERPRET:
                v = tl.where(v == v, v, 0.0)
            else:
                # One max.f16x2 per two values (PTX's max returns the operand that is not NaN, and
                # no e4m3 value is below -448): a select costs three instructions a value and is
                # kept for the interpreter, whose maximum propagates NaN.
                v = tl.maximum(v, tl.full(v.shape, -448.0, v.dtype))
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    m_i = m_new
    return m_i, l_i, acc


# num_seqs changes every step: Triton would specialise it (== 1, divisible by 16) and compile again.
@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    out_ptr, part_acc_ptr, part_ml_ptr,
    q_ptr, k_ptr, v_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr, sinks_ptr, head_scale_ptr,
    k_scale_ptr, v_scale_ptr, scale, softcap, num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_bt, stride_pt, stride_ph, stride_ps,
    GQA: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, CHUNK: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, HAS_HEAD_SCALE: tl.constexpr, NUM_SPLITS: tl.constexpr, FP8: tl.constexpr,
    DOT_F32: tl.constexpr, F16_DOT: tl.constexpr, PRECISION: tl.constexpr, DECODE: tl.constexpr,
    GROUPED: tl.constexpr, FP8_PV: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        # One token a sequence, token s of sequence s: no lookups before the context length
        # and the query. The context length is a step's input, written before its forward
        # began: read before the PDL wait (kernels/pdl.py).
        seq = pid_q
        q_start = pid_q
        q_len = 1
        q_block = 0
        seq_len = tl.load(seq_lens_ptr + seq)
        pdl_wait(PDL)
    else:
        pdl_wait(PDL)
        seq = _find_seq(query_start_loc_ptr, num_seqs, pid_q, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        q_block = pid_q - (q_start // BLOCK_Q + seq)
        if q_block * BLOCK_Q >= q_len:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GQA  # token index inside the sequence's query
    head = kv_head * GQA + rows % GQA
    row_ok = (rows < BLOCK_Q * GQA) & (tok < q_len)
    pos = context + tok  # absolute position of each row's query
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM

    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    elif F16_DOT:
        q = q.to(tl.float16)
    if FP8:
        scale = scale * tl.load(k_scale_ptr)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2
    row_scale = 1.0
    if HAS_HEAD_SCALE:
        row_scale = tl.load(head_scale_ptr + head, mask=row_ok, other=1.0).to(tl.float32)

    # Key range read by this program's rows.
    first_pos = context + q_block * BLOCK_Q
    last_pos = tl.minimum(context + q_block * BLOCK_Q + BLOCK_Q, seq_len) - 1
    kv_lo = 0
    if SLIDING_WINDOW > 0:
        kv_lo = tl.maximum(first_pos - SLIDING_WINDOW + 1, 0)
    if CHUNK > 0:
        kv_lo = (first_pos // CHUNK) * CHUNK
    kv_hi = last_pos + 1
    tile_lo = kv_lo // TILE_N
    tile_hi = (kv_hi + TILE_N - 1) // TILE_N
    if NUM_SPLITS > 1:
        per_split = (tile_hi - tile_lo + NUM_SPLITS - 1) // NUM_SPLITS
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + per_split)

    if HAS_SINKS and split == 0:
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        l_i = tl.where(row_ok, 1.0, 0.0)
        if FP8_PV:
            l_i = l_i * 256.0
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)

    bt_row = block_table_ptr + seq * stride_bt
    # FP8_PV's first and last tiles are peeled off: they alone zero their values outside
    # [kv_lo, kv_hi) (`_attend_tile`).
    loop_lo = tile_lo
    loop_hi = tile_hi
    if FP8_PV:
        if tile_hi > tile_lo:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile_lo, kv_lo, kv_hi, pos, bt_row, k_ptr, v_ptr, kv_head, dims, dim_ok,
                scale, qk_scale, softcap, row_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                stride_vh, BLOCK_SIZE, TILE_N, HEAD_DIM_PAD, SLIDING_WINDOW, CHUNK, USE_SOFTCAP, HAS_HEAD_SCALE,
                FP8, DOT_F32, PRECISION, GROUPED, FP8_PV, INTERPRET, True, False)
        loop_lo = tile_lo + 1
        loop_hi = tile_hi - 1
    for tile in range(loop_lo, loop_hi):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, tile, kv_lo, kv_hi, pos, bt_row, k_ptr, v_ptr, kv_head, dims, dim_ok, scale,
            qk_scale, softcap, row_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
            BLOCK_SIZE, TILE_N, HEAD_DIM_PAD, SLIDING_WINDOW, CHUNK, USE_SOFTCAP, HAS_HEAD_SCALE, FP8, DOT_F32,
            PRECISION, GROUPED, FP8_PV, INTERPRET, False, DECODE and NUM_SPLITS > 1)
    if FP8_PV:
        if tile_hi - 1 > tile_lo:
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, tile_hi - 1, kv_lo, kv_hi, pos, bt_row, k_ptr, v_ptr, kv_head, dims, dim_ok,
                scale, qk_scale, softcap, row_scale, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                stride_vh, BLOCK_SIZE, TILE_N, HEAD_DIM_PAD, SLIDING_WINDOW, CHUNK, USE_SOFTCAP, HAS_HEAD_SCALE,
                FP8, DOT_F32, PRECISION, GROUPED, FP8_PV, INTERPRET, True, False)

    if FP8:
        acc = acc * tl.load(v_scale_ptr)
    tok_global = q_start + tok
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok_global[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        base = tok_global * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part_acc_ptr + base[:, None] * HEAD_DIM_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + base * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(out_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh, stride_pt, stride_ph,
                         stride_ps, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         PDL: tl.constexpr):
    """out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M), per (token, head); the partials
    loaded at once (one round trip, not two)."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    base = t * stride_pt + h * stride_ph + splits * stride_ps
    m = tl.load(part_ml_ptr + base * 2)
    l_s = tl.load(part_ml_ptr + base * 2 + 1)
    acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM_PAD + dims[None, :])
    m_max = tl.max(m, 0)
    # Empty splits have m = -inf: weight 0. A sequence with no keys at all (a CUDA graph's
    # padding) has every split empty: its output is 0, not NaN.
    w = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    denom = tl.sum(l_s * w, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def _interpreter_bf16(q: torch.Tensor) -> bool:
    """Triton 3.9's CPU interpreter computes bf16 `tl.dot` wrongly (a 16x16 product off by
    ~1e10), fp16 and fp32 right: under the interpreter, bf16 products run in fp32. On a GPU the
    bf16 path is the one compiled and tested."""
    return os.environ.get("TRITON_INTERPRET") == "1" and q.dtype == torch.bfloat16


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def batch_fills_gpu(num_seqs: int, num_kv_heads: int, num_sms: int) -> bool:
    """Whether a decode batch has a program (a sequence and KV head) for every SM without splits."""
    return num_seqs * num_kv_heads >= num_sms


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int,
                      tile_n: int = 64, max_splits: int = 32, sliding_window: int = 0, chunk_size: int = 0) -> int:
    """Splits of the key range for a decode batch too small to fill the GPU: enough programs for
    ~2 waves, at least one key tile per split (the merge kernel combines them). A split's time is
    its chain of dependent loads, so more splits win as long as they have work: H200, B=1, Gemma-3's
    heads, tile 64, each inside a CUDA graph (`kernels/bench/decode_batch1.py`): 600 keys 9.4 us with 16
    splits against 11.2 with 8; 2,048 keys 13.1 us with 32 against 17.8 with 8; 8,192 keys 27.6
    against 55.7. 1 = no split. A query reads at most a window's keys (a local chunk's), which span
    one tile more than they fill: splits beyond those tiles would only write empty partials for the
    merge to read (gpt-oss-120b, window 128, 128-key tiles, batch 1: 2 splits where the graph's
    bound of 1,024 tokens gave 8, and 4,096 or more 32; a decode step 2.112-2.118 ms against
    2.129-2.142 at that bound, H200)."""
    if batch_fills_gpu(num_seqs, num_kv_heads, num_sms):
        return 1
    programs = num_seqs * num_kv_heads
    keys = max_seq_len
    for span in (sliding_window, chunk_size):
        if span:
            keys = min(keys, span + tile_n)
    tiles = keys // tile_n
    want = min(triton.cdiv(2 * num_sms, programs), max(tiles, 1), max_splits)
    return _next_pow2(want) if want > 1 else 1


def _tile_n(block_size: int, tile: int) -> int:
    """Keys per tile: a power of two. A tile may span blocks or part of one (each key looks its
    block up): a power-of-two block up to 256 gives one block per tile; any other block size
    (a Mamba hybrid's, e.g. 176) the default tile."""
    if block_size & (block_size - 1) == 0 and block_size <= 256:
        return max(block_size, tile)
    return tile


def _tiles(max_query_len: int, head_dim: int, gqa: int, block_size: int, sliding_window: int = 0,
           max_seq_len: int = 0, fp8: bool = False, fills_gpu: bool = True) -> dict:
    """Tile shapes and launch options, the fastest of sweeps on an H200 (bf16, block 16; D=128 with
    Hq=32, Hkv=8: `distengine bench kernels --sweep`; D=256 with Hq=16, Hkv=8, Gemma-3-12B's
    shape: kernels/bench/sweep_decode_attention.py). `fills_gpu`: `batch_fills_gpu` of a decode batch."""
    block_m = max(16, _next_pow2(gqa))
    if head_dim > 256:
        # Gemma 4's full layers (D=512, Hq=32, Hkv=4; `kernels/bench/sweep_decode_attention.py
        # --heads gemma4 [--prefill]`, H200): 32-key tiles, two stages. Decode at 3.8-4.1 TB/s
        # (B=128 x 600, B=16 x 16k). Prefill: 64 query rows with 8 warps, 12.4 ms for 8,192 tokens
        # against 14.2 with 32 rows and 25.1 with 32 rows and 8 warps; wider key tiles or a third
        # stage spill or overflow shared memory.
        if max_query_len == 1:
            return {"BLOCK_M": block_m, "TILE_N": 32, "num_warps": 4, "num_stages": 2}
        return {"BLOCK_M": max(block_m, 64), "TILE_N": 32, "num_warps": 8, "num_stages": 2}
    if max_query_len == 1 and fp8 and head_dim in (128, 256) and gqa <= 4 and fills_gpu:
        # An e4m3 cache is bound by its conversion in registers, not by its bytes: on 4 warps its
        # converted tiles filled 255 registers and spilled (2 programs an SM, 12% occupancy,
        # ncu). 1-warp programs on 32-key tiles convert more tiles at once. H200, fp16 products
        # (`default_config`), the 4-warp rule below in the same run, us: Gemma-3-12B's heads (GQA
        # 2), B=128 x 8,192 keys 1,191 against 1,789 (1.18x the copy time of the bytes against
        # 1.78x); window 1,024: 192 against 254; B=128 x 600: 104 against 164; D=128 with GQA 4,
        # B=128 x 8,192: 675 against 960. Not taken (no gain shown): batches split across the SMs
        # (2-warp programs: B=16 x 16k 478 against 510; at B=1 1.09-1.19x, where two runs of
        # the same tiles differed by up to 1.17x), and GQA 8, whose products use 8 of 16 rows
        # (B=128 x 8,192: 452 on 4 warps against 624 at best on small tiles).
        return {"BLOCK_M": block_m, "TILE_N": 32, "num_warps": 1, "num_stages": 3}
    if max_query_len == 1 and fp8 and head_dim == 256:
        # Gemma-3-12B's heads with 128-key tiles on 4 warps, B=128 x 8,192 keys: 1.80 ms (8
        # warps: 2.86; bf16 products 2.13; a bf16 cache 1.97); window 1,024: one stage, 259 us.
        stages = 1 if sliding_window else 3
        return {"BLOCK_M": block_m, "TILE_N": _tile_n(block_size, 128), "num_warps": 4, "num_stages": stages}
    if max_query_len == 1:  # decode: bandwidth-bound, 4 warps keep enough loads in flight
        # A window's first tile is partly masked: wider tiles waste less at D=128 (W=1024: 0.082
        # vs 0.106 ms); at D=256 a 128-key tile is too large (B=128, 600 tokens: 210 vs 176 us).
        tile = 128 if sliding_window and head_dim <= 128 else 64
        # At D=256 long contexts gain a third stage (B=16, 16k tokens: 532 vs 632 us).
        stages = 3 if head_dim > 128 and max_seq_len >= 4096 else 2
        return {"BLOCK_M": block_m, "TILE_N": _tile_n(block_size, tile), "num_warps": 4, "num_stages": stages}
    if head_dim <= 128 and max_query_len < 8192:
        return {"BLOCK_M": max(block_m, 64), "TILE_N": _tile_n(block_size, 64), "num_warps": 4, "num_stages": 3}
    tile = 128 if head_dim <= 128 else 64
    return {"BLOCK_M": max(block_m, 128), "TILE_N": _tile_n(block_size, tile), "num_warps": 8, "num_stages": 3}


def default_config(max_query_len: int, head_dim: int, gqa: int, block_size: int, sliding_window: int = 0,
                   max_seq_len: int = 0, fp8: bool = False, fills_gpu: bool = True) -> dict:
    """The tiles (`_tiles`) and, for an e4m3 cache at decode, `F16_DOT`: the products in fp16, the
    query cast to it, so that each cached byte takes one conversion instruction (e4m3x2 to f16x2; to bf16 it
    takes three). Exact for the cache (every e4m3 value is an fp16 one) and finer than bf16 for
    the probabilities; a query beyond fp16's range (65,504) would overflow. fp32 queries keep
    fp32 products."""
    cfg = _tiles(max_query_len, head_dim, gqa, block_size, sliding_window, max_seq_len, fp8, fills_gpu)
    if fp8 and max_query_len == 1:
        cfg["F16_DOT"] = True
    return cfg


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, max_query_len: int, max_seq_len: int, scale: float,
    sliding_window: int = 0, chunk_size: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
    head_scale: torch.Tensor | None = None, out: torch.Tensor | None = None, num_splits: int | None = None,
    config: dict | None = None, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `q[num_tokens, Hq, D]` over the paged K/V of `kv_cache[num_blocks, 2,
    block_size, Hkv, D]`, for a ragged batch (`query_start_loc[num_seqs+1]`, `seq_lens[num_seqs]`
    = context including the new tokens, whose K/V are already stored). `max_query_len` and
    `max_seq_len` are host integers (bounds are fine); they pick the tile shape and the splits.
    An fp8 `kv_cache` takes its `k_scale` and `v_scale` (`kernels.kv_store`).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, two, block_size, num_kv_heads, head_dim_kv = kv_cache.shape
    if two != 2 or head_dim_kv != head_dim:
        raise ValueError(f"kv_cache must be [num_blocks, 2, block_size, {num_kv_heads}, {head_dim}], "
                         f"got {tuple(kv_cache.shape)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if sliding_window and chunk_size:
        raise ValueError("a layer has a sliding window or a local chunk, not both")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q and kv_cache need a contiguous last dimension")
    check_scales(kv_cache, k_scale, v_scale)
    fp8 = is_fp8(kv_cache)
    grouped = value_group(kv_cache) > 1
    gqa = num_q_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    num_sms = _num_sms(q.device)
    cfg = config or default_config(max_query_len, head_dim, gqa, block_size, sliding_window, max_seq_len, fp8,
                                   fills_gpu=batch_fills_gpu(num_seqs, num_kv_heads, num_sms))
    block_m = cfg["BLOCK_M"]
    if grouped and (kv_cache.stride(2), kv_cache.stride(3)) != (num_kv_heads * head_dim, head_dim):
        raise ValueError(f"an fp8 cache needs each block's [block_size, heads, head_dim] contiguous, got strides "
                         f"{tuple(kv_cache.stride())}")
    if grouped and cfg["TILE_N"] % VALUE_GROUP.value:
        raise ValueError(f"an fp8 cache's values come in groups of {VALUE_GROUP.value} keys: TILE_N must be a "
                         f"multiple, got {cfg['TILE_N']}")
    block_q = max(1, block_m // gqa)
    if num_splits is None:
        # At D=512 each split's partial row is 2 KiB to merge: 8 splits at most (B=1, 600 keys,
        # H200: 41 us against 56 with the 32 the rule gives D=256).
        num_splits = (choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms, cfg["TILE_N"],
                                        max_splits=8 if head_dim > 256 else 32, sliding_window=sliding_window,
                                        chunk_size=chunk_size)
                      if max_query_len == 1 else 1)
    head_dim_pad = max(16, _next_pow2(head_dim))
    k_cache, v_cache = kv_cache[:, 0], kv_cache[:, 1]
    # A decode batch (one token a sequence) maps program s to sequence s (`DECODE`).
    decode = max_query_len == 1 and num_tokens == num_seqs
    num_q_blocks = num_seqs if decode else num_tokens // block_q + num_seqs
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_q_heads, num_splits, head_dim_pad, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(num_tokens, num_q_heads, num_splits, 2, dtype=torch.float32, device=q.device)
        pstrides = (num_q_heads * num_splits, num_splits, 1)
    else:
        part_acc = part_ml = out  # unused
        pstrides = (0, 0, 0)
    dummy = q
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        out, part_acc, part_ml, q, k_cache, v_cache, block_table, query_start_loc, seq_lens,
        sinks if sinks is not None else dummy, head_scale if head_scale is not None else dummy,
        k_scale if fp8 else dummy, v_scale if fp8 else dummy,
        float(scale), float(softcap) if softcap else 1.0, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), *pstrides,
        GQA=gqa, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, TILE_N=cfg["TILE_N"], SLIDING_WINDOW=int(sliding_window), CHUNK=int(chunk_size),
        USE_SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None, HAS_HEAD_SCALE=head_scale is not None,
        NUM_SPLITS=num_splits, FP8=fp8, DOT_F32=_interpreter_bf16(q), GROUPED=grouped,
        FP8_PV=grouped and max_query_len > 1 and q.element_size() == 2 and cfg["TILE_N"] >= 32,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        F16_DOT=fp8 and q.element_size() == 2 and cfg.get("F16_DOT", False),
        # fp32 models (tests against transformers) get full-precision products, not TF32.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DECODE=decode, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_args(q),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out, part_acc, part_ml, out.stride(0), out.stride(1), *pstrides,
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, num_warps=4, **pdl_args(q))
    return out


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
