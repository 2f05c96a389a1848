"""Mixture-of-experts feed-forward: each token's hidden state through its top-k experts' gated
MLPs, the outputs weighted by the router and summed.

    y[t] = sum_j  w[t, j] * W2[e_tj] @ act(W13[e_tj] @ x[t])        (e_tj = topk_ids[t, j])

`fused_experts` runs it in two grouped GEMM launches (vLLM's fused_moe layout): the (token, j)
pairs are sorted by expert and each expert's run padded to whole BLOCK_M tiles (`moe_align`),
so a program multiplies one tile of rows that all use one expert's weights, and reads only the
weights of experts that some token chose. The first launch gives [T*k, 2I] (gate | up), the
activation kernel [T*k, I] (experts without a gate: the first launch gives [T*k, I] of up rows
alone and the activation is elementwise), the second launch [T*k, H] already scaled by the routing weights,
and a sum over k (one more launch) gives [T, H]. Decode-sized steps (16- and 32-row tiles) whose
activation is one of `kernels.activation`'s without parameters (`fusable`) apply it in the first
launch's epilogue, a program computing a tile of gate rows and the matching up rows: at batch 1
a step is launch-bound, and this is one launch a layer fewer. With `weight_input` (Llama-4, which scales each
routed token's hidden state by its router score before the expert) the first launch scales its
rows instead: x w W13^T = w (x W13^T) with no bias in between, so the activation sees the
scaled input and the second launch leaves its rows as they are. Every shape is fixed by T, k, E and BLOCK_M (the alignment is one
Triton program for a decode step's few pairs, torch ops of static shape beyond), so a decode
step with experts is captured in a CUDA graph like any other. `fused_experts_ref` is the plain
loop over experts (the engine's path on CPU, and the tests' oracle).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.activation import apply_act, fusable
from kernels.fp8 import FP8_DTYPE, dequantize_fp8_ref
from kernels.gemv import SCALE_BLOCK, SCALE_ROW
from kernels.moe_gemv import expert_scale_args, experts_gemv, takes as gemv_takes
from kernels.paged_attention import _interpreter_bf16
from kernels.pdl import pdl_args, pdl_wait

__all__ = ["ExpertScales", "compile_align_variants", "fused_experts", "fused_experts_ref", "moe_align", "moe_align_kernel",
           "moe_align_torch", "moe_config", "tokens_per_tile_band"]


ALIGN_KERNEL_MAX_PAIRS = 2048  # one program sorts the pairs in registers: beyond, the torch ops


def align_kernel_width(num_pairs: int) -> int:
    """The pairs the align program sorts (a power of two, at least 64): a few compiled variants
    (`align_kernel_widths`) rather than one per batch size."""
    return max(64, triton.next_power_of_2(num_pairs))


def align_kernel_widths() -> list[int]:
    """A pair count of each width the align program compiles for (warm-up runs them all)."""
    widths, w = [], 64
    while w <= ALIGN_KERNEL_MAX_PAIRS:
        widths.append(w)
        w *= 2
    return widths


def align_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of `moe_align`'s output: every used expert's run padded to whole tiles, at most
    min(E, pairs) experts used; fixed by the shapes alone (a CUDA graph's buffers)."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> (rows, block_expert).

    rows [P]: the flat (token, j) indices t*k + j sorted by expert (in token order within one),
    each expert's run padded to a multiple of `block_m` with T*k (no row); P = `align_size`, the
    most any routing needs. block_expert [P / block_m]: the expert of each tile, -1 past the last
    used tile. On a GPU, up to ALIGN_KERNEL_MAX_PAIRS pairs (a
    decode step's) in one Triton program instead of ~10 torch kernels."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [tokens, k], got {tuple(topk_ids.shape)}")
    n = topk_ids.numel()
    if topk_ids.is_cuda and 0 < n <= ALIGN_KERNEL_MAX_PAIRS:
        return moe_align_kernel(topk_ids, num_experts, block_m)
    return moe_align_torch(topk_ids, num_experts, block_m)


@dataclass(frozen=True)
class RowTiles:
    """Which rows each program of the grouped GEMMs takes: `moe_align`'s rows and block_expert,
    or with `pair_tiles` (a single token: its k experts are distinct) none of them, tile j being
    the pair j alone, of expert block_expert[j] = topk_ids[0, j]; that saves the alignment's
    launch at batch 1."""
    rows: torch.Tensor
    block_expert: torch.Tensor
    pair_tiles: bool

    @property
    def num_tiles(self) -> int:
        return self.block_expert.numel()


def row_tiles(topk_ids: torch.Tensor, num_experts: int, block_m: int, pair_tiles: bool = True) -> RowTiles:
    """The tiles of a batch; `pair_tiles` False aligns a single token too."""
    if topk_ids.shape[0] == 1 and pair_tiles:
        ids = topk_ids.reshape(-1).contiguous()
        return RowTiles(ids, ids, True)
    return RowTiles(*moe_align(topk_ids, num_experts, block_m), False)


@triton.jit
def tile_of(rows_ptr, bexp_ptr, num_rows, n_tiles, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            PAIR_TILES: tl.constexpr):
    """`RowTiles` in a GEMM program of `grid_of`'s grid: the expert of its row tile (-1: none, the
    program returns), the tile's rows (num_rows: padding) and which are pairs, its column tile,
    that tile's columns and which are below N."""
    pid_m = tl.program_id(0) // n_tiles
    expert = tl.load(bexp_ptr + pid_m).to(tl.int64)
    if PAIR_TILES:
        rows = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_rows)
    else:
        rows = tl.load(rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pid_n = tl.program_id(0) % n_tiles
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return expert, rows, rows < num_rows, pid_n, rn, rn < N


def grid_of(tiles: RowTiles, n: int, block_n: int) -> tuple[tuple[int], int]:
    """A grouped GEMM's grid and its column tiles a row tile. The column tiles of one row tile are
    consecutive programs (`tile_of`), so that they run side by side and read the tile's rows and
    the expert's weights from L2, where launching the row tiles first made each column tile walk
    every expert again. One H200, prefill steps in CUDA graphs, us: Qwen3.6-35B-A3B's experts at
    8,192 tokens 1,233 against 1,290, Granite-4.0-H-Small's 3,288 against 3,508, 1,024 tokens 4-6%
    faster at four shapes, decode sizes the same."""
    n_tiles = triton.cdiv(n, block_n)
    return (tiles.num_tiles * n_tiles,), n_tiles


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align` in torch ops of static shape (any device)."""
    dev = topk_ids.device
    size = align_size(topk_ids.numel(), num_experts, block_m)
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    # The narrowest key that holds the ids: the GPU's radix sort makes a pass a key byte (one H200,
    # 65,536 pairs of 256 experts, in a CUDA graph: this function 92 us with uint8 against 147 with int64).
    key = flat.to(torch.uint8) if num_experts <= 256 else flat.to(torch.int16) if num_experts <= 32768 else flat
    order = torch.sort(key, stable=True).indices  # pairs grouped by expert, in token order within one
    expert_of = flat[order]
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[expert_of]
    rows = torch.full((size,), n, dtype=torch.int32, device=dev)
    rows[(ends - padded)[expert_of] + rank] = order.to(torch.int32)
    starts = torch.arange(0, size, block_m, device=dev)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where(starts < ends[-1], block_expert, -1).to(torch.int32)
    return rows, block_expert


@triton.jit
def _max_of(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["n", "size"])
def _moe_align_kernel(ids_ptr, rows_ptr, bexp_ptr, keys_ptr, n, size, N_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                      CHUNK: tl.constexpr, PDL: tl.constexpr):
    """One program: sort the pairs by (expert, index) in registers, so that each expert's pairs
    form a run; a pair's rank in its run and the run's padded start (an exclusive sum, over the
    pairs before it, of each run's size padded to whole tiles, counted at the run's last pair) give
    its slot; the first pair of each tile names the tile's expert. The sentinels go in first."""
    pdl_wait(PDL)
    for start in range(0, size, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(rows_ptr + offs, tl.zeros([CHUNK], tl.int32) + n, mask=offs < size)
        tl.store(bexp_ptr + offs, tl.full([CHUNK], -1, tl.int32), mask=offs < size // BLOCK_M)
    pos = tl.arange(0, N_P2)
    valid = pos < n
    ids = tl.load(ids_ptr + pos, mask=valid, other=0).to(tl.int32)
    # Pairs past n sort last (the largest key); N_P2 <= 2**11 and experts < 2**20 keep it in int32.
    keys = tl.sort(tl.where(valid, ids * N_P2 + pos, 0x7FFFFFFF))
    tl.store(keys_ptr + pos, keys)
    tl.debug_barrier()  # the sorted keys and the sentinels are in before any thread reads or overwrites them
    expert = keys // N_P2
    before = tl.load(keys_ptr + pos - 1, mask=pos > 0, other=-1) // N_P2
    after = tl.load(keys_ptr + pos + 1, mask=pos + 1 < n, other=-1) // N_P2
    run_start = tl.associative_scan(tl.where(before != expert, pos, 0), 0, _max_of)
    rank = pos - run_start
    padded = tl.where(valid & (after != expert), (rank + BLOCK_M) // BLOCK_M * BLOCK_M, 0)
    slot = tl.cumsum(padded, 0) - padded + rank
    tl.store(rows_ptr + slot, keys % N_P2, mask=valid)
    tl.store(bexp_ptr + slot // BLOCK_M, expert, mask=valid & (rank % BLOCK_M == 0))


def moe_align_kernel(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_align` in one Triton program (any device; the engine uses it on GPUs for small batches)."""
    n = topk_ids.numel()
    if n > ALIGN_KERNEL_MAX_PAIRS:
        raise ValueError(f"moe_align_kernel takes at most {ALIGN_KERNEL_MAX_PAIRS} pairs, got {n}")
    size = align_size(n, num_experts, block_m)
    ids = topk_ids.reshape(-1)
    rows = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    n_p2 = align_kernel_width(n)
    keys = torch.empty(n_p2, dtype=torch.int32, device=ids.device)
    _moe_align_kernel[(1,)](ids, rows, block_expert, keys, n, size, N_P2=n_p2, BLOCK_M=block_m, CHUNK=1024,
                            num_warps=8 if n_p2 > 256 else 4, **pdl_args(ids))
    return rows, block_expert


@triton.jit
def _as_operand(w, s_rows, n_ok, blk, DT: tl.constexpr, SCALE: tl.constexpr):
    """A weight tile [BLOCK_N, BLOCK_K] as the product's operand in DT: FP8 values convert exactly;
    with block scales (of the tile's rows at K block `blk`) dequantized and rounded to DT, the
    numbers of the dense FP8 layers' prefill (`kernels.fp8.dequantize_fp8`, then the product).
    Scaling each step's product instead held a second fp32 accumulator: 128 x 256 prefill tiles
    spilled (one H200, Qwen3.6-35B-A3B's experts at 8,192 tokens, 179 ms a step against ~43 for
    bf16 experts)."""
    out = w
    if SCALE == SCALE_BLOCK:
        out = (w.to(tl.float32) * tl.load(s_rows + blk, mask=n_ok, other=0.0)[:, None]).to(DT)
    elif SCALE == SCALE_ROW:
        out = w.to(DT)
    return out


@triton.jit(do_not_specialize=["num_rows"])  # T*k changes with every prefill's length
def _moe_gemm_kernel(a_ptr, w_ptr, b_ptr, c_ptr, rw_ptr, rows_ptr, bexp_ptr, s_ptr, N, K, num_rows, n_tiles,
                     stride_am, stride_we, stride_wn, stride_be, stride_cm, stride_se, stride_sn, BN_Q, BK_Q,
                     A_ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTED: tl.constexpr,
                     ACT: tl.constexpr, GATED: tl.constexpr, PAIR_TILES: tl.constexpr, SCALE: tl.constexpr,
                     DOT_F32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of c[rows] = a[rows // A_ROW_DIV] @ w[e]^T (+ b[e]) (* rw[rows])
    for the tile's expert e. ACT >= 0 (`kernels.activation.apply_act`) applies the activation to
    the tile; GATED: of w[e]'s rows n (gate) and N + n (up), c being [.., N]. SCALE (FP8 weights,
    `kernels.gemv`'s codes): one scale per row of w[e] (s [E, rows]), multiplying the sums, or one
    per BN_Q x BK_Q block (s [E, rows / BN_Q, K / BK_Q]; a K step lies in one), see `_as_operand`."""
    pdl_wait(PDL)
    expert, rows, row_ok, pid_n, rn, n_ok = tile_of(rows_ptr, bexp_ptr, num_rows, n_tiles, N, BLOCK_M, BLOCK_N,
                                                    PAIR_TILES)
    if expert < 0:
        return
    rk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (rows // A_ROW_DIV).to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + expert * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    # (the interpreter rounds fp32 to bf16 toward zero: its bf16 products, already fp32, take the
    # dequantized weights unrounded)
    DT: tl.constexpr = tl.float32 if DOT_F32 else a_ptr.dtype.element_ty
    s_gate = s_ptr + expert * stride_se + (rn // BN_Q) * stride_sn
    s_up = s_ptr + expert * stride_se + ((N + rn) // BN_Q) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = _as_operand(tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0), s_gate, n_ok,
                        k // BK_Q, DT, SCALE)
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
        if GATED:
            wu = _as_operand(tl.load(w_rows + N * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                                     other=0.0), s_up, n_ok, k // BK_Q, DT, SCALE)
            if DOT_F32:
                wu = wu.to(tl.float32)
            up = tl.dot(a, tl.trans(wu), up, input_precision=PRECISION)
    if SCALE == SCALE_ROW:
        acc *= tl.load(s_gate, mask=n_ok, other=0.0)[None, :]
        if GATED:
            up *= tl.load(s_up, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            up += tl.load(b_ptr + expert * stride_be + N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTED:
        rw = tl.load(rw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        acc *= rw
        up *= rw
    if ACT >= 0:
        # The activation reads its inputs rounded to c's dtype, as from the unfused [R, 2I] buffer.
        acc = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(c_ptr.dtype.element_ty).to(tl.float32)
        acc = apply_act(acc, up, 0.0, 0.0, ACT, GATED)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


# Rows per expert (pairs / E) up to which moe_config picks 16-row tiles, then 32-row ones.
ROW_BANDS = (12, 24, 64)


def moe_config(num_pairs: int, num_experts: int, itemsize: int = 2) -> dict:
    """Tiles by the rows each expert gets (pairs / E), from H200 sweeps in CUDA graphs at the
    shapes of kernels/bench/moe.py (kernels/bench/sweep_moe_tiles.py): up to 12 rows 16-row tiles (a decode
    step's tiles are mostly padding; a larger one would only multiply zeros), to 24 rows 32-row
    tiles, to 64 rows 64-row tiles (1-256 tokens: within 3% of each point's best tiles, where the
    rule of pairs <= 4 E before lost up to 8%); beyond, prefill steps, 128 x 256 tiles (1,024 to
    8,192 tokens: within 2.1% of each point's best, 1.1-1.4x faster than 64 x 128 from 4,096 tokens)
    for 16-bit operands; 4-byte ones (fp32 tests) keep 64 x 128, whose 4 stages fit in shared
    memory where 128 x 256 would need 384 KB."""
    rows = num_pairs / num_experts
    if rows <= ROW_BANDS[0]:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if rows <= ROW_BANDS[1]:
        return {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    if rows <= ROW_BANDS[2] or itemsize > 2:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}


def tokens_per_tile_band(num_experts: int, top_k: int) -> list[int]:
    """A batch size that lands in each of moe_config's bands: running one of each compiles every
    variant a later batch may need."""
    return [1] + [-(-(band + 1) * num_experts // top_k) for band in ROW_BANDS]


@dataclass(frozen=True)
class ExpertScales:
    """FP8 experts' scales (W = weight * scale, `kernels.fp8`): `block` (bn, bk) with w13 [E,
    2I / bn, H / bk] and w2 [E, H / bn, I / bk] (whole blocks: a gate or up half, and a step of the
    kernels' K loop, never shares one), or None with one scale per row, w13 [E, 2I], w2 [E, H]
    (per-tensor scales served as per-row ones, as the FP8 linears do)."""
    w13: torch.Tensor
    w2: torch.Tensor
    block: tuple[int, int] | None

    def check(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        for name, w, s in (("w13", w13, self.w13), ("w2", w2, self.w2)):
            if w.dtype != FP8_DTYPE:
                raise TypeError(f"{name}: FP8 experts need {FP8_DTYPE} weights, got {w.dtype}")
            if s.dtype != torch.float32 or s.stride(-1) != 1:
                raise TypeError(f"{name}: FP8 expert scales must be float32 with contiguous rows, got {s.dtype} "
                                f"strides {s.stride()}")
            e, n, k = w.shape
            if self.block is None:
                want = (e, n)
            else:
                bn, bk = self.block
                if n % bn or k % bk or bk % 16:
                    raise ValueError(f"{name} {tuple(w.shape)}: FP8 scale blocks {self.block} must tile its rows "
                                     f"and keys whole (and hold a multiple of 16 keys)")
                want = (e, n // bn, k // bk)
            if tuple(s.shape) != want:
                raise ValueError(f"{name}: FP8 expert scales must be {want}, got {tuple(s.shape)}")

    def of(self, which: str) -> torch.Tensor:
        return self.w13 if which == "w13" else self.w2


def _grouped_gemm(a, w, b, tiles: RowTiles, out, routed, a_row_div: int, cfg: dict,
                  act: tuple[int, bool] | None = None, scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None) -> None:
    """out[rows] = a[rows // a_row_div] @ w[e]^T (+ b) (* routed); with `act` (`fusable`'s (ACT,
    GATED)) its activation, of (gate, up) row pairs n and N + n when gated (out [rows, N]). An FP8
    w takes its `scale` (`ExpertScales`' w13 or w2, with `block`)."""
    k = w.shape[2]
    code, gated = act if act is not None else (-1, False)
    n = out.shape[1]
    if scale is not None and block is not None:
        cfg = dict(cfg, BLOCK_K=min(cfg["BLOCK_K"], block[1] & -block[1]))  # each K step in one block
    grid, n_tiles = grid_of(tiles, n, cfg["BLOCK_N"])
    _moe_gemm_kernel[grid](
        a, w, b if b is not None else a, out, routed if routed is not None else out, tiles.rows, tiles.block_expert,
        N=n, K=k, num_rows=out.shape[0], n_tiles=n_tiles, stride_am=a.stride(0), stride_we=w.stride(0),
        stride_wn=w.stride(1), stride_be=b.stride(0) if b is not None else 0, stride_cm=out.stride(0),
        **expert_scale_args(scale, block, a), A_ROW_DIV=a_row_div, HAS_BIAS=b is not None,
        MUL_ROUTED=routed is not None, ACT=code, GATED=gated, PAIR_TILES=tiles.pair_tiles, DOT_F32=_interpreter_bf16(a),
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_args(a))


def _check(x, w13, w2, topk_weights, topk_ids, b13, b2, weight_input: bool = False,
           scales: ExpertScales | None = None) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"x must be [T, H], w13 [E, 2I, H] (or [E, I, H]) and w2 [E, H, I], got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    e, two_i, h = w13.shape
    if h != x.shape[1] or tuple(w2.shape[:2]) != (e, h) or two_i not in (w2.shape[2], 2 * w2.shape[2]):
        raise ValueError(f"expert shapes do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)} (want [E, 2I or I, "
                         f"{x.shape[1]}]), w2 {tuple(w2.shape)} (want [{e}, {h}, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must both be [{x.shape[0]}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if b13 is not None and tuple(b13.shape) != (e, two_i) or b2 is not None and tuple(b2.shape) != (e, h):
        raise ValueError(f"biases must be [{e}, {two_i}] and [{e}, {h}]")
    if weight_input and (b13 is not None or b2 is not None):
        raise ValueError("weights on the experts' input need experts without biases (a bias would be scaled too)")
    for name, t in (("w13", w13), ("w2", w2), ("b13", b13), ("b2", b2)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} needs contiguous rows (last stride 1), got strides {t.stride()}")
    if scales is not None:
        scales.check(w13, w2)
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"FP8 experts take bf16, fp16 or fp32 activations, got {x.dtype}")
    elif not (x.dtype == w13.dtype == w2.dtype):
        raise TypeError(f"x and the expert weights need one dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")


@triton.jit
def _moe_sum_kernel(src_ptr, dst_ptr, h, K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """dst[t] = sum_j src[t * K + j] in fp32, rounded once."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < h
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(src_ptr + (t * K + j) * h + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + t * h + cols, acc.to(dst_ptr.dtype.element_ty), mask=mask)


def _sum_over_k(out: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """[t * k, H] -> [t, H]: one launch (a torch sum in fp32 and the cast back would be two)."""
    h = out.shape[1]
    y = torch.empty((t, h), dtype=out.dtype, device=out.device)
    block = min(1024, triton.next_power_of_2(h))
    _moe_sum_kernel[(t, triton.cdiv(h, block))](out, y, h, K=k, BLOCK_H=block, num_warps=4, **pdl_args(out))
    return y


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, act_and_mul, b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, config: dict | None = None,
                  weight_input: bool = False, scales: ExpertScales | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], topk_weights / topk_ids
    [T, k] -> [T, H] in x's dtype; `act_and_mul` maps [R, 2I] -> [R, I] (e.g. silu(gate) * up).
    Experts without a gate (Nemotron-H's) have w13 [E, I, H] (up rows alone, told apart by w2's
    I) and an elementwise activation [R, I] -> [R, I] (e.g. `relu2`).
    Ids must lie in [0, E) (the router's top-k). `weight_input`: the weights scale each pair's
    input, sum_j W2 act(W13 (w_tj x_t)), rather than its output. Without `config`, up to
    a few tokens through narrow experts (FP8 experts of any width: one token) run as GEMVs
    (`kernels.moe_gemv.takes`), the same numbers
    in two launches. FP8 experts (`scales`) read their weights at one byte an element in both
    ways, the products in x's dtype (grouped GEMMs) or fp32 (GEMVs)."""
    _check(x, w13, w2, topk_weights, topk_ids, b13, b2, weight_input, scales)
    t, k = topk_ids.shape
    e, two_i, h = w13.shape
    if t == 0:
        return x.new_zeros((0, h))
    act = fusable(act_and_mul)
    if act is not None and two_i != w2.shape[2] * (2 if act[1] else 1):
        act = None
    if config is None and gemv_takes(t, w2.shape[2], fp8=scales is not None):
        return experts_gemv(x, w13, w2, topk_weights, topk_ids, act_and_mul, act, b13, b2, weight_input,
                            scales=scales)
    cfg = config or moe_config(t * k, e, x.element_size())
    tiles = row_tiles(topk_ids, e, cfg["BLOCK_M"])
    x = x if x.stride(1) == 1 else x.contiguous()
    routed = topk_weights.reshape(-1).contiguous()
    first_routed = routed if weight_input else None

    def fp8(which: str) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
        return (None, None) if scales is None else (scales.of(which), scales.block)

    if act is not None and cfg["BLOCK_M"] <= 32:
        # Decode-sized steps apply the activation in the first launch: one launch a layer fewer. A
        # gated program reads BLOCK_N gate and BLOCK_N up rows: half the columns, as many rows.
        inter = torch.empty((t * k, w2.shape[2]), dtype=x.dtype, device=x.device)
        first = dict(cfg, BLOCK_N=cfg["BLOCK_N"] // 2) if act[1] else cfg
        _grouped_gemm(x, w13, b13, tiles, inter, first_routed, k, first, act, *fp8("w13"))
    else:
        gate_up = torch.empty((t * k, two_i), dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, b13, tiles, gate_up, first_routed, k, cfg, None, *fp8("w13"))
        inter = act_and_mul(gate_up)
    out = torch.empty((t * k, h), dtype=x.dtype, device=x.device)
    _grouped_gemm(inter, w2, b2, tiles, out, None if weight_input else routed, 1, cfg, None, *fp8("w2"))
    return _sum_over_k(out, t, k)


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, act_and_mul, b13: torch.Tensor | None = None,
                      b2: torch.Tensor | None = None, weight_input: bool = False,
                      scales: ExpertScales | None = None) -> torch.Tensor:
    """The same sum as a loop over the experts that some token chose, in fp32 (fp64 for fp64
    inputs); the activation's input and output rounded to x's dtype as the kernel's are. FP8
    experts are dequantized in that precision (`kernels.fp8.dequantize_fp8_ref`)."""
    _check(x, w13, w2, topk_weights, topk_ids, b13, b2, weight_input, scales)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    t, k = topk_ids.shape
    out = torch.zeros((t, x.shape[1]), dtype=acc, device=x.device)
    flat = topk_ids.reshape(-1)

    def weight(which: str, e: int) -> torch.Tensor:
        w = (w13 if which == "w13" else w2)[e]
        if scales is None:
            return w.to(acc)
        return dequantize_fp8_ref(w, scales.of(which)[e], scales.block, acc)

    for e in torch.unique(flat).tolist():
        pairs = (flat == e).nonzero().flatten()
        tokens = pairs // k
        w = topk_weights.reshape(-1)[pairs].to(acc)[:, None]
        h = (x[tokens].to(acc) * w if weight_input else x[tokens].to(acc)) @ weight("w13", e).T
        if b13 is not None:
            h = h + b13[e].to(acc)
        h = act_and_mul(h.to(x.dtype)).to(acc) @ weight("w2", e).T
        if b2 is not None:
            h = h + b2[e].to(acc)
        out.index_add_(0, tokens, h if weight_input else h * w)
    return out.to(x.dtype)


def compile_align_variants(num_experts: int, top_k: int, itemsize: int, device, block_m_of=None) -> None:
    """Run the align program once in each variant a batch of up to ALIGN_KERNEL_MAX_PAIRS pairs
    compiles (its sort width and tile rows), so that none compiles while serving. `block_m_of`
    maps a pair count to its tile rows (default: `moe_config`'s)."""
    block_m_of = block_m_of or (lambda n: moe_config(n, num_experts, itemsize)["BLOCK_M"])
    variants: dict[tuple[int, int], int] = {}
    for n in range(top_k, ALIGN_KERNEL_MAX_PAIRS + 1, top_k):
        variants.setdefault((align_kernel_width(n), block_m_of(n)), n)
    for (_, block_m), n in variants.items():
        moe_align_kernel(torch.zeros(n // top_k, top_k, dtype=torch.int64, device=device), num_experts, block_m)
