"""A few tokens' routed experts as GEMVs on the CUDA cores: two launches, no alignment, no sum.

At a decode step of one or a few tokens the grouped GEMMs of `kernels.fused_moe` pad each
(token, expert) pair to a 16-row tensor-core tile, need the pairs sorted by expert (one more
launch beyond one token) and a launch that sums each token's k rows. Here each program of the
first launch owns BLOCK_N columns of one pair's gate and up rows (the expert read from the
router's ids) and writes the activation; each program of the second owns BLOCK_N columns of one
token's output and loads them for all of that token's k pairs at once, summing them itself, so
the sum needs no launch of its own. The products are `kernels.gemv`'s: each run of CHUNK keys
summed in registers before the accumulator.

Numbers as the grouped path's: the activation reads its inputs rounded to the output dtype, and
each pair's down product (times its router weight) is rounded to it before the fp32 sum over the
pairs that is rounded once (summed as a tree here, in pair order there).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.activation import apply_act
from kernels.gemv import SCALE_BLOCK, SCALE_NONE, SCALE_ROW, check_chunk
from kernels.pdl import pdl_args, pdl_wait

__all__ = ["FP8_GEMV_ANY_WIDTH_TOKENS", "GEMV_MAX_INTERMEDIATE", "GEMV_MAX_TOKENS", "expert_scale_args", "experts_gemv",
           "moe_gemv_config", "takes"]

# `kernels.fused_moe.fused_experts` runs its experts here up to GEMV_MAX_TOKENS tokens for
# experts of at most GEMV_MAX_INTERMEDIATE intermediate columns (a rank's). One H200, bf16, REPS
# calls in a CUDA graph each with its own routing (`kernels.bench.moe --few`), us at 1 / 2 / 4
# tokens, GEMVs against the grouped GEMMs: Qwen3.6-35B-A3B's experts (I 512) 18.3 / 30.5 / 53.2
# against 18.3 / 33.6 / 59.4, Granite-4.0-H-Tiny's (I 512) 12.3 / 19.9 / 31.9 against 13.6 / 21.3 /
# 34.0; wider experts were as fast or slower (Granite-4.0-H-Small's, I 768: 53.7 / 97.2 / 175.3
# against 51.7 / 100.1 / 147.9; gpt-oss-20b's in bf16, I 2,880: 56.3 / 98.4 / 170.9 against
# 55.4 / 97.6 / 162.4), and Nemotron-3-Nano's decode step at batch 1 (I 1,856, two shared
# slots) was 2.45 ms against 2.40 with them. FP8 experts of any width take them for one token:
# there the grouped GEMMs convert whole 16-row tiles of which one row is used, and
# Nemotron-3-Nano's FP8 step at batch 1 took 1.886-1.895 ms with the GEMVs against 2.159-2.170
# (A B B A in one call, one H200); at 2 and 4 tokens 5.58 / 6.89 ms against 5.52 / 5.62 (bf16
# weights at one token: 2.243-2.249 against 2.258-2.264, too close to change their rule).
GEMV_MAX_TOKENS = 4
GEMV_MAX_INTERMEDIATE = 512
FP8_GEMV_ANY_WIDTH_TOKENS = 1


@triton.jit
def _pair_products(a_rows, w, kk, j_ok, k_ok, SLOTS_P2: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                   CHUNK: tl.constexpr):
    """The K step kk of every pair's rows: w [SLOTS_P2, ROWS, BLOCK_K] times its pair's input, each
    run of CHUNK keys summed (`kernels.gemv._gemv_products`) -> fp32 [SLOTS_P2, ROWS, BLOCK_K // CHUNK]."""
    x = tl.load(a_rows[:, None] + kk[None, :], mask=j_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    p = w.to(tl.float32) * x[:, None, :]
    if CHUNK > 1:
        p = tl.sum(tl.reshape(p, [SLOTS_P2, ROWS, BLOCK_K // CHUNK, CHUNK]), 3)
    return p


@triton.jit
def _scaled(p, s_rows, ok, k, K, BK_Q, SCALE: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    """FP8 block scales (`kernels.gemv`'s codes) on one K step's run sums p [SLOTS_P2, ROWS,
    BLOCK_K // CHUNK]: each run lies in one block (CHUNK divides its keys), whose scale it takes
    (rows `ok` and runs before K; the others' sums are zeros)."""
    if SCALE == SCALE_BLOCK:
        start = k + tl.arange(0, BLOCK_K // CHUNK) * CHUNK
        p = p * tl.load(s_rows[:, :, None] + (start // BK_Q)[None, None, :],
                        mask=ok[:, :, None] & (start < K)[None, None, :], other=0.0)
    return p


@triton.jit
def _moe_gemv_kernel(a_ptr, w_ptr, b_ptr, c_ptr, rw_ptr, ids_ptr, s_ptr, N, K, stride_am, stride_we, stride_wn,
                     stride_be, stride_cm, stride_se, stride_sn, BN_Q, BK_Q, SLOTS: tl.constexpr,
                     SLOTS_P2: tl.constexpr, A_ROW_DIV: tl.constexpr,
                     HAS_BIAS: tl.constexpr, MUL_ROUTED: tl.constexpr, ACT: tl.constexpr, HALVES: tl.constexpr,
                     EARLY: tl.constexpr, SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     CHUNK: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_N columns of output row r = program_id(0). ACT < 0: the sum over its SLOTS pairs
    p = r * SLOTS + j of a[p // A_ROW_DIV] @ w[e_p]^T (+ b[e_p]) (* rw[p]), e_p = ids[p], each
    term rounded to c's dtype. ACT >= 0 (one slot): the activation of those columns, of the
    (gate rows n, up rows N + n) when HALVES is 2. SCALE: FP8 weights with `kernels.fused_moe`'s
    `ExpertScales` (s [E, rows] per row, or [E, rows / BN_Q, K / BK_Q] blocks, each run of CHUNK
    keys inside one).

    A program loads the weight rows of all its pairs (and both halves) as one [SLOTS_P2, HALVES *
    BLOCK_N, BLOCK_K] tile: a loop over the pairs, one load after the other, left a program a
    few KB in flight and ran at a third of the copy rate.

    EARLY (the second launch): the ids and the first K step's weight tile are read before the PDL
    wait. The ids come from a kernel at least two launches back, done by then: the launch before
    this one lets it start only after its own wait (`kernels/pdl.py`)."""
    if not EARLY:
        pdl_wait(PDL)
    row = tl.program_id(0)
    r = tl.arange(0, HALVES * BLOCK_N)  # (gate, up) rows interleaved, column by column
    rn = tl.program_id(1) * BLOCK_N + r // HALVES
    w_row = (rn + (r % HALVES) * N).to(tl.int64)
    j = tl.arange(0, SLOTS_P2)
    j_ok = j < SLOTS
    pair = row * SLOTS + j
    expert = tl.load(ids_ptr + pair, mask=j_ok, other=0).to(tl.int64)
    a_rows = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    w_rows = w_ptr + expert[:, None] * stride_we + w_row[None, :] * stride_wn
    ok = j_ok[:, None] & (rn < N)[None, :]
    rk = tl.arange(0, BLOCK_K)
    k_ok = rk < K
    w = tl.load(w_rows[:, :, None] + rk[None, None, :], mask=ok[:, :, None] & k_ok[None, None, :], other=0.0)
    s_rows = s_ptr + expert[:, None] * stride_se + (w_row // BN_Q)[None, :] * stride_sn
    if EARLY:
        pdl_wait(PDL)
    acc = _scaled(_pair_products(a_rows, w, rk, j_ok, k_ok, SLOTS_P2, HALVES * BLOCK_N, BLOCK_K, CHUNK),
                  s_rows, ok, 0, K, BK_Q, SCALE, BLOCK_K, CHUNK)
    for k in range(BLOCK_K, K, BLOCK_K):
        kk = k + rk
        k_ok = kk < K
        w = tl.load(w_rows[:, :, None] + kk[None, None, :], mask=ok[:, :, None] & k_ok[None, None, :], other=0.0)
        acc += _scaled(_pair_products(a_rows, w, kk, j_ok, k_ok, SLOTS_P2, HALVES * BLOCK_N, BLOCK_K, CHUNK),
                       s_rows, ok, k, K, BK_Q, SCALE, BLOCK_K, CHUNK)
    v = tl.sum(acc, 2)
    if SCALE == SCALE_ROW:
        v *= tl.load(s_rows, mask=ok, other=0.0)
    if HAS_BIAS:
        v += tl.load(b_ptr + expert[:, None] * stride_be + w_row[None, :], mask=ok, other=0.0).to(tl.float32)
    if MUL_ROUTED:
        v *= tl.load(rw_ptr + pair, mask=j_ok, other=0.0).to(tl.float32)[:, None]
    out_ty = c_ptr.dtype.element_ty
    v = v.to(out_ty).to(tl.float32)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if ACT >= 0:
        v = tl.reshape(v, [HALVES * BLOCK_N])
        if HALVES == 2:
            gate, up = tl.split(tl.reshape(v, [BLOCK_N, 2]))
        else:
            gate, up = v, v
        y = apply_act(gate, up, 0.0, 0.0, ACT, HALVES == 2)
    else:
        y = tl.sum(v, 0)
    tl.store(c_ptr + row.to(tl.int64) * stride_cm + cols, y.to(out_ty), mask=cols < N)


# A program's weight tile, in elements (32 KB of bf16). One token's experts on one H200
# (`kernels.bench.moe --gemv-sweep`: tiles of 4K to 32K elements on 2, 4 or 8 warps, one launch
# at a time): this on 4 warps was within 4% of the best of either launch at each of the four
# shapes, and the tiles differed by little more (35B-A3B: 25-31 us).
TILE_ELEMENTS = 16384


def moe_gemv_config(k: int, slots: int, halves: int, elem_bytes: int) -> dict:
    """Tiles for a weight of K columns whose program sums `slots` pairs of `halves` row sets: K
    steps of up to 2,048 (runs of 16 keys summed first for 16-bit and FP8 weights, `kernels.gemv`),
    and as many columns as keep the tile at TILE_ELEMENTS (FP8 too: Qwen3.6-35B-A3B's batch-1 step
    on one H200 took 2.094-2.107 ms in two runs with tiles of twice the elements, the bytes of
    bf16's, against 2.096-2.106); fp32 weights (tests) short steps."""
    block_k = min(2048 if elem_bytes <= 2 else 256, max(16, triton.next_power_of_2(k)))
    rows = max(1, TILE_ELEMENTS // (triton.next_power_of_2(slots) * block_k))
    return {"BLOCK_N": max(1, rows // halves), "BLOCK_K": block_k, "num_warps": 4,
            "CHUNK": 16 if elem_bytes <= 2 else 1}


def expert_scale_args(scale: torch.Tensor | None, block: tuple[int, int] | None, placeholder: torch.Tensor) -> dict:
    """The expert kernels' FP8 scale arguments (`kernels.fused_moe.ExpertScales`' w13 or w2 and
    its block; none: `placeholder` stands in for the pointer)."""
    bn, bk = block if block is not None else (1, 1)
    return dict(s_ptr=scale if scale is not None else placeholder,
                stride_se=scale.stride(0) if scale is not None else 0,
                stride_sn=scale.stride(1) if scale is not None else 0, BN_Q=bn, BK_Q=bk,
                SCALE=SCALE_NONE if scale is None else SCALE_ROW if block is None else SCALE_BLOCK)


def _launch(a, w, b, ids, out, routed, slots: int, a_row_div: int, n: int, act: tuple[int, bool] | None,
            config: dict | None, early: bool = False, scale: torch.Tensor | None = None,
            block: tuple[int, int] | None = None) -> None:
    k = w.shape[2]
    code, gated = act if act is not None else (-1, False)
    halves = 2 if gated else 1
    cfg = config or moe_gemv_config(k, slots, halves, w.element_size())
    chunk = check_chunk(cfg)
    if scale is not None and block is not None and block[1] % chunk:
        raise ValueError(f"FP8 scale blocks of {block[1]} keys need runs ({chunk} keys) that divide them")
    grid = (out.shape[0], triton.cdiv(n, cfg["BLOCK_N"]))
    _moe_gemv_kernel[grid](
        a, w, b if b is not None else a, out, routed if routed is not None else out, ids, N=n, K=k,
        stride_am=a.stride(0), stride_we=w.stride(0), stride_wn=w.stride(1),
        stride_be=b.stride(0) if b is not None else 0, stride_cm=out.stride(0), **expert_scale_args(scale, block, a),
        SLOTS=slots, SLOTS_P2=triton.next_power_of_2(slots), A_ROW_DIV=a_row_div, HAS_BIAS=b is not None,
        MUL_ROUTED=routed is not None, ACT=code, HALVES=halves, EARLY=early, BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        CHUNK=chunk, num_warps=cfg["num_warps"], num_stages=1, **pdl_args(a))


def takes(tokens: int, intermediate: int, fp8: bool = False) -> bool:
    """Whether a batch of `tokens` through experts of `intermediate` columns (`fp8`: stored in
    FP8) runs here."""
    if fp8 and tokens <= FP8_GEMV_ANY_WIDTH_TOKENS:
        return True
    return tokens <= GEMV_MAX_TOKENS and intermediate <= GEMV_MAX_INTERMEDIATE


def experts_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, act_and_mul, act: tuple[int, bool] | None, b13: torch.Tensor | None,
                 b2: torch.Tensor | None, weight_input: bool, configs: tuple[dict, dict] | None = None,
                 scales=None) -> torch.Tensor:
    """`kernels.fused_moe.fused_experts` (its checks done) for a few tokens: each pair's gate/up
    GEMV with the activation `act` (`kernels.activation.fusable`'s (ACT, GATED)) in its epilogue,
    or without one the raw product and `act_and_mul` after it; then each token's down GEMVs summed
    over its k pairs. `configs`: the two launches' tiles (default `moe_gemv_config`). FP8 weights
    come with their `scales` (`kernels.fused_moe.ExpertScales`)."""
    fp13, fp2 = ((scales.w13, scales.block), (scales.w2, scales.block)) if scales is not None else ((), ())
    t, k = topk_ids.shape
    inter, h = w2.shape[2], w2.shape[1]
    ids = topk_ids.reshape(-1).contiguous()
    routed = topk_weights.reshape(-1).contiguous()
    first, second = configs or (None, None)
    x = x if x.stride(1) == 1 else x.contiguous()
    if act is not None:
        gate_up = torch.empty((t * k, inter), dtype=x.dtype, device=x.device)
        _launch(x, w13, b13, ids, gate_up, routed if weight_input else None, 1, k, inter, act, first, False, *fp13)
        y = gate_up
    else:
        gate_up = torch.empty((t * k, w13.shape[1]), dtype=x.dtype, device=x.device)
        _launch(x, w13, b13, ids, gate_up, routed if weight_input else None, 1, k, w13.shape[1], None, first, False,
                *fp13)
        y = act_and_mul(gate_up)
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    # The ids are two launches back here (three without a fused activation): read before the wait.
    _launch(y, w2, b2, ids, out, None if weight_input else routed, k, 1, h, None, second, True, *fp2)
    return out
