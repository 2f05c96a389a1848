"""y = x W^T (+ b) for the few rows of a decode step: `gemv` for one row, `skinny_gemm` for 2-32.

Why Triton kernels: at a few rows a projection only streams its weight, and cuBLAS picks tiles
made for wider products (64 or more output columns per tile, split-K with a second reduce
kernel for the narrow matrices). Timed inside CUDA graphs on one H200, 24 calls each on its own
weights (`kernels/bench/decode_batch1.py`), Gemma-3-12B's shapes, one row: o_proj 10.1 us against
F.linear's 13.4, down_proj 29.2 against 34.2, gate_up 54.8 against 58.0, qkv 17.2 against 17.7:
the weight read at 3.1 / 4.0 / 4.3 / 3.7 TB/s (copy 4.24 TB/s); a batch-1 decode step of the
whole model 7.15 ms against 7.95. At 2 / 8 / 16 / 32 rows (`launch/bench/decode_batched.py`) a layer's
four projections take 115.4 / 116.8 / 118.1 / 123.0 us against cuBLAS's 124.3 / 124.7 / 128.2 /
128.8 (copy-rate time 105.1), and the decode step at batch 4 / 8 / 16 / 32 is 7.65 / 7.97 / 8.57 /
9.74 ms against 8.21 / 8.49 / 9.10 / 10.06; from 64 rows on cuBLAS is as fast. The layers call
them through `workers.ops.linear_op`; more rows, and the LM head (0.45 ms in cuBLAS at one row,
at the copy rate already), go to F.linear.

`gemv`: one program owns BLOCK_N output columns and walks K in BLOCK_K steps, accumulating x * W
in fp32 registers (for FP8 and most bf16 weights each run of 16 keys summed first, `gemv_config`)
and reducing across K once at the end, so every weight element is read once and the partial sums
never leave the program. `skinny_gemm`: the same walk with the rows padded
to a 16- or 32-row tile and the product on the tensor cores (`tl.dot`), the weight tile first
(SWAP) where that was faster. The weight's rows must be contiguous (any row stride).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.activation import apply_act, sigmoid_gate
from kernels.fp8 import check_fp8_weight, dequantize_fp8_ref
from kernels.gated_rmsnorm import GatedRMSNorm, gated_norm_values
from kernels.mamba_conv import ConvStep, conv_step
from kernels.paged_attention import _interpreter_bf16
from kernels.pdl import pdl_args, pdl_wait

__all__ = ["gemv", "gemv_ref", "gemv_config", "fuses_gated_norm", "NORM_MAX_COLUMNS", "NORM_MAX_GROUP",
           "skinny_gemm", "skinny_gemm_ref", "skinny_config", "SKINNY_MAX_ROWS", "FP8_SKINNY_MAX_ROWS"]


# FP8 weights' scales (kernels.fp8): none, one per output row, one per (BN_Q x BK_Q) block.
SCALE_NONE, SCALE_ROW, SCALE_BLOCK = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _gemv_x(x_ptr, z_ptr, nw_ptr, s_row, k, K, BK_Q, eps, SCALE: tl.constexpr, NORM: tl.constexpr,
            GROUP: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
            GATE: tl.constexpr, ACT: tl.constexpr, GATED: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[k : k + BLOCK_K] in fp32, through the gated norm (NORM), times sigmoid(z) (GATE) or as
    the activation ACT >= 0 of x's gate half (times its up half, K further on, when GATED), and
    times its block scales."""
    kk = k + tl.arange(0, BLOCK_K)
    k_ok = kk < K
    if NORM:  # the gated RMSNorm of x: a K step holds whole groups (GROUP divides BLOCK_K)
        gk = k + tl.arange(0, BLOCK_K // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        g_ok = gk < K
        x = gated_norm_values(tl.load(x_ptr + gk, mask=g_ok, other=0.0).to(tl.float32),
                              tl.load(z_ptr + gk, mask=g_ok, other=0.0).to(tl.float32),
                              tl.load(nw_ptr + gk, mask=g_ok, other=0.0).to(tl.float32), GROUP, eps,
                              NORM_BEFORE_GATE, ROUND_BEFORE_WEIGHT, x_ptr.dtype.element_ty)
        x = tl.reshape(x, [BLOCK_K]).to(tl.float32)
    else:
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0)
        if ACT >= 0:  # `kernels.activation`'s kernel: its formula, its output rounded to x's dtype
            up = x
            if GATED:
                up = tl.load(x_ptr + K + kk, mask=k_ok, other=0.0)
            x = apply_act(x.to(tl.float32), up.to(tl.float32), 0.0, 0.0, ACT, GATED).to(x_ptr.dtype.element_ty)
        if GATE:
            z = tl.load(z_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            x = sigmoid_gate(x.to(tl.float32), z, x_ptr.dtype.element_ty)
        x = x.to(tl.float32)
    if SCALE == SCALE_BLOCK:
        x *= tl.load(s_row + kk // BK_Q, mask=k_ok, other=0.0)
    return x


@triton.jit
def _gemv_products(w, x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr):
    """w * x in fp32, each run of CHUNK keys summed (CHUNK 1: the whole tile). The accumulator
    holds one fp32 register per element it keeps: a whole tile costs two (bf16) or four (FP8)
    times the registers of its bytes, which capped the bytes in flight (`gemv_config`). A run of
    16 is one 16-byte load of FP8 (summed in its thread) or two of bf16 (two threads, one shuffle)."""
    p = w.to(tl.float32) * x[None, :]
    if CHUNK > 1:
        p = tl.sum(tl.reshape(p, [BLOCK_N, BLOCK_K // CHUNK, CHUNK]), 2)
    return p


def check_chunk(cfg: dict) -> int:
    """A config's CHUNK (1 if it has none), refused unless a power of two dividing BLOCK_K."""
    chunk = cfg.get("CHUNK", 1)
    if not isinstance(chunk, int) or chunk < 1 or chunk & (chunk - 1) or cfg["BLOCK_K"] % chunk:
        raise ValueError(f"CHUNK must be a power of two dividing BLOCK_K={cfg['BLOCK_K']}, got {chunk!r}")
    return chunk


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, s_ptr, z_ptr, nw_ptr, eps, N, K, stride_wn, stride_sn, BN_Q, BK_Q,
                 cw_ptr, cb_ptr, cs_ptr, c_init_ptr, c_write_ptr, C0, CD, stride_cw, cs_page, cs_row,
                 HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, NORM: tl.constexpr, GROUP: tl.constexpr,
                 NORM_BEFORE_GATE: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, GATE: tl.constexpr,
                 ACT: tl.constexpr, GATED: tl.constexpr, CONV: tl.constexpr,
                 CONV_K: tl.constexpr, CONV_BIAS: tl.constexpr, CONV_SILU: tl.constexpr, CONV_R: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    # The weight is written by no kernel of a step, so the first K step's tile is read before the
    # wait: with PDL the fetch overlaps the kernel before (kernels/pdl.py). That step is peeled
    # off the loop; carrying the next tile through the loop instead held twice the registers and
    # slowed the 1,024-wide steps (an FP8 down_proj of Gemma-3-12B: 40.6 against 22.4 us).
    w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0)
    pdl_wait(PDL)
    # A program's rows lie in one scale block (BN_Q is a multiple of BLOCK_N): its scales vary
    # along K only, and scale x rather than the wider weight tile.
    s_row = s_ptr + (pid * BLOCK_N // BN_Q) * stride_sn
    acc = _gemv_products(w, _gemv_x(x_ptr, z_ptr, nw_ptr, s_row, 0, K, BK_Q, eps, SCALE, NORM, GROUP,
                                    NORM_BEFORE_GATE, ROUND_BEFORE_WEIGHT, GATE, ACT, GATED, BLOCK_K), BLOCK_N,
                         BLOCK_K, CHUNK)
    for k in range(BLOCK_K, K, BLOCK_K):
        kk = k + rk
        w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
        acc += _gemv_products(w, _gemv_x(x_ptr, z_ptr, nw_ptr, s_row, k, K, BK_Q, eps, SCALE, NORM, GROUP,
                                         NORM_BEFORE_GATE, ROUND_BEFORE_WEIGHT, GATE, ACT, GATED, BLOCK_K),
                              BLOCK_N, BLOCK_K, CHUNK)
    y = tl.sum(acc, 1)
    if SCALE == SCALE_ROW:
        y *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if CONV:  # columns [C0, C0 + CD) through a decode step of the causal conv, from the product as stored
        d = rn - C0
        dm = n_ok & (d >= 0) & (d < CD)
        d = tl.where(dm, d, 0)
        src = tl.load(c_init_ptr).to(tl.int64)
        dst = tl.load(c_write_ptr).to(tl.int64)
        c = conv_step(y.to(y_ptr.dtype.element_ty), d, dm, cw_ptr, cb_ptr, cs_ptr, src, dst, stride_cw, cs_page,
                      cs_row, CONV_K, CONV_BIAS, CONV_SILU, CONV_R)
        y = tl.where(dm, c, y)
    tl.store(y_ptr + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)


# bf16 outputs of up to this many columns (routers) take programs of 2 columns over the whole K:
# 8 a program left a router a few dozen programs. One H200, one row, 96 weights in a CUDA graph,
# us against 8 x 4,096 on 8 warps: gpt-oss-120b's router [128, 2,880] 1.34 against 1.57, a
# [128, 2,816] one 1.19 against 1.57, Qwen3.6-35B-A3B's [257, 2,048] 1.39 against 1.39.
NARROW_COLUMNS = 1024


def gemv_config(n: int, k: int, elem_bytes: int = 2) -> dict:
    """Tiles from H200 sweeps (CUDA graphs, REPS weights each, one row). 1- and 2-byte weights sum
    each thread's 16 keys in registers (CHUNK, `_gemv_products`) and take long K steps: a whole-tile
    accumulator costs an fp32 register an element, which capped the bytes in flight.
    - FP8: 16 columns x 4,096 keys on 8 warps up to 4,096 columns, 16 x 2,048 on 4 beyond.
      Gemma-3-12B's projections with block scales (`kernels.bench.fp8_gemv`), us against the
      whole-tile 16 x 1,024: qkv 8.92 against 12.87, o_proj 6.10 against 6.80, gate_up 28.84
      against 45.77, down 16.99 against 23.34.
    - bf16 with K up to 4,096: 8 columns x 4,096 keys on 8 warps up to 4,096 columns, 8 x 2,048 on
      4 beyond. Against the whole-tile tiles below, us: gpt-oss-120b qkv (5,120 x 2,880) 8.04
      against 11.53, o_proj 7.11 / 7.67; Qwen3.6-35B-A3B in_proj (12,288 x 2,048) 13.11 / 14.72,
      out_proj (2,048 x 4,096) 5.07 / 6.37; Gemma-3-12B qkv 15.81 / 16.29, o_proj 8.70 / 8.54,
      gate_up 52.24 / 61.26. Whole batch-1 steps, each against the whole-tile tiles in the same
      call: gpt-oss-120b 2.99 against 3.10 ms, Qwen3.6-35B-A3B 2.70 against 2.77, but Gemma-3-12B
      6.72 against 6.66, slower although its products alone are faster (not explained yet).
    - bf16 outputs of up to NARROW_COLUMNS columns (routers): 2 columns x the whole K on 4 warps.
    - Wider K in bf16 (Gemma-3-12B's down_proj, every Qwen3.6-27B projection) and fp32 weights
      (routers) keep the whole-tile accumulator: few output columns over a long K want wide
      programs, 16 columns x 1,024 keys on 8 warps; many columns narrow ones, 4-8 x 256 on 4 warps,
      so that ~2,000-4,000 programs spread the read."""
    if elem_bytes == 1:
        if n <= 4096:
            return {"BLOCK_N": 16, "BLOCK_K": 4096, "num_warps": 8, "num_stages": 1, "CHUNK": 16}
        return {"BLOCK_N": 16, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 1, "CHUNK": 16}
    if elem_bytes == 2 and k <= 4096:
        if n <= NARROW_COLUMNS:
            return {"BLOCK_N": 2, "BLOCK_K": min(4096, max(16, triton.next_power_of_2(k))), "num_warps": 4,
                    "num_stages": 1, "CHUNK": 16}
        if n <= 4096:
            return {"BLOCK_N": 8, "BLOCK_K": 4096, "num_warps": 8, "num_stages": 1, "CHUNK": 16}
        return {"BLOCK_N": 8, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 1, "CHUNK": 16}
    if n <= 4096:
        return {"BLOCK_N": 16, "BLOCK_K": 1024, "num_warps": 8, "num_stages": 1}
    if n <= 16384:
        return {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1}


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int = 1,
           scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> None:
    if max_rows == 1 and (x.dim() != 2 or x.shape[0] != 1):
        raise ValueError(f"gemv takes one row x [1, K], got {tuple(x.shape)}")
    if x.dim() != 2 or not 1 <= x.shape[0] <= max_rows:
        raise ValueError(f"skinny_gemm takes 1 to {max_rows} rows x [M, K], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, {x.shape[1]}], got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if scale is not None:
        check_fp8_weight(weight, scale, block)
    elif x.dtype != weight.dtype and not (max_rows == 1 and _widened(x, weight)):
        raise TypeError(f"x, weight and bias need one dtype (gemv: or a 16-bit x with an fp32 weight), got {x.dtype}, "
                        f"{weight.dtype}, {None if bias is None else bias.dtype}")
    if bias is not None and bias.dtype != _out_dtype(x, weight, scale):
        raise TypeError(f"x, weight and bias need one dtype, got {x.dtype}, {weight.dtype}, {bias.dtype}")


def _widened(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A 16-bit x against an fp32 weight (a router kept in fp32, as transformers' Nemotron-H
    runs it on x.float()): the GEMV widens x in registers, so that the cast is no launch of its own."""
    return weight.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.dtype:
    return weight.dtype if scale is None and _widened(x, weight) else x.dtype


def _scale_args(weight: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
                block_n: int, block_k: int | None = None) -> dict:
    """The kernels' scale arguments; a block-scaled weight needs each program's rows (and, for
    `skinny_gemm`, each K step) inside one scale block."""
    if scale is None:
        return dict(s_ptr=weight, stride_sn=0, BN_Q=1, BK_Q=1, SCALE=SCALE_NONE)
    if block is None:
        return dict(s_ptr=scale, stride_sn=0, BN_Q=1, BK_Q=1, SCALE=SCALE_ROW)
    if block[0] % block_n or (block_k is not None and block[1] % block_k):
        raise ValueError(f"scale blocks {block} must be whole multiples of the tile ({block_n} rows"
                         f"{'' if block_k is None else f', {block_k} keys'})")
    return dict(s_ptr=scale, stride_sn=scale.stride(0), BN_Q=block[0], BK_Q=block[1], SCALE=SCALE_BLOCK)


# Which gated norms the GEMV takes. Batch-1 decode steps on one H200: Qwen3.6-35B-A3B (its Gated
# DeltaNet heads, groups of 128; out_proj 2,048 columns) took 2.79 ms with the norm in the output
# projection against 2.84 without; Nemotron-3-Nano's groups of 512 lost (2.49 against 2.46 ms,
# the same call). Qwen3.6-27B's out_proj (5,120 columns) runs ~1,300 four-column programs, each
# redoing the norm (~36 KB of y, z and the norm weight beside its 48 KB of weight): its step took
# 14.21 ms with the norm in a launch of its own against 14.54 with it in the GEMV (two runs each,
# one call), hence the column bound.
NORM_MAX_GROUP = 128
NORM_MAX_COLUMNS = 4096


def _norm_groups_fit(norm: GatedRMSNorm) -> bool:
    """Whether the norm's groups tile the GEMV's K steps: a power of two, at most NORM_MAX_GROUP."""
    g = norm.group_size
    return 0 < g <= NORM_MAX_GROUP and g & (g - 1) == 0


def fuses_gated_norm(norm: GatedRMSNorm, n: int) -> bool:
    """Whether a one-row product of `n` output columns should apply `norm` inside `gemv` (else the
    norm runs first in its own launch): groups `gemv` can take, and at most NORM_MAX_COLUMNS."""
    return _norm_groups_fit(norm) and n <= NORM_MAX_COLUMNS


def _check_norm(x: torch.Tensor, norm: GatedRMSNorm) -> None:
    k = x.shape[1]
    if not _norm_groups_fit(norm):
        raise ValueError(f"gemv applies a gated norm of power-of-two groups up to {NORM_MAX_GROUP}, "
                         f"got groups of {norm.group_size}")
    if k % norm.group_size:
        raise ValueError(f"the norm's groups of {norm.group_size} must divide K={k}")
    if tuple(norm.z.shape) != (1, k) or norm.z.stride(1) != 1 or norm.z.dtype != x.dtype:
        raise ValueError(f"the norm's gate must be a [1, {k}] {x.dtype} row with unit column stride, got "
                         f"{tuple(norm.z.shape)} {norm.z.dtype}")
    if tuple(norm.weight.shape) != (k,) or not norm.weight.is_contiguous():
        raise ValueError(f"the norm's weight must be a contiguous [{k}], got {tuple(norm.weight.shape)}")


def _act_input(x: torch.Tensor, weight: torch.Tensor, act: tuple[int, bool] | None) -> torch.Tensor:
    """The [1, K] part of x the checks see: with a gated `act`, x must be [1, 2K] (gate | up)."""
    if act is None or not act[1]:
        return x
    k = weight.shape[-1] if weight.dim() == 2 else -1
    if x.dim() != 2 or x.shape[-1] != 2 * k:
        raise ValueError(f"a gated activation's input must be [1, 2K] = [1, {2 * k}] (gate | up), got "
                         f"{tuple(x.shape)}")
    return x[:, :k]


def _check_gate(x: torch.Tensor, gate: torch.Tensor, norm: GatedRMSNorm | None) -> None:
    if norm is not None:
        raise ValueError("gemv takes a gated norm or a sigmoid gate, not both")
    if tuple(gate.shape) != tuple(x.shape) or gate.dtype != x.dtype or gate.stride(-1) != 1:
        raise ValueError(f"the gate must be a {tuple(x.shape)} {x.dtype} row with unit column stride, got "
                         f"{tuple(gate.shape)} {gate.dtype}")


def _conv_args(conv: ConvStep | None, x: torch.Tensor) -> dict:
    """The kernel's conv arguments (placeholders without one)."""
    if conv is None:
        return dict(cw_ptr=x, cb_ptr=x, cs_ptr=x, c_init_ptr=x, c_write_ptr=x, C0=0, CD=0, stride_cw=0, cs_page=0,
                    cs_row=0, CONV=False, CONV_K=2, CONV_BIAS=False, CONV_SILU=False, CONV_R=1)
    k = conv.weight.shape[1]
    return dict(cw_ptr=conv.weight, cb_ptr=conv.bias if conv.bias is not None else conv.weight, cs_ptr=conv.state,
                c_init_ptr=conv.init_page, c_write_ptr=conv.write_page, C0=conv.start, CD=conv.channels,
                stride_cw=conv.weight.stride(0), cs_page=conv.state.stride(0), cs_row=conv.state.stride(1),
                CONV=True, CONV_K=k, CONV_BIAS=conv.bias is not None, CONV_SILU=conv.activation is not None,
                CONV_R=triton.next_power_of_2(k - 1))


def _check_conv(conv: ConvStep, n: int) -> None:
    conv.check((1, n))
    d, k = conv.weight.shape
    if conv.weight.stride(1) != 1 or conv.state.dim() != 3 or tuple(conv.state.shape[1:]) != (k - 1, d) \
            or conv.state.stride(2) != 1 or (conv.bias is not None and tuple(conv.bias.shape) != (d,)):
        raise ValueError(f"the conv needs a [D, K] weight with unit last stride, a [pages, K-1, D] state with unit "
                         f"last stride and a [D] bias or none; got {tuple(conv.weight.shape)}, "
                         f"{tuple(conv.state.shape)}, {None if conv.bias is None else tuple(conv.bias.shape)}")
    if conv.activation not in (None, "silu", "swish"):
        raise ValueError(f"the conv's activation must be silu or none, got {conv.activation!r}")


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, config: dict | None = None,
         weight_scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None,
         norm: GatedRMSNorm | None = None, conv: ConvStep | None = None,
         gate: torch.Tensor | None = None, act: tuple[int, bool] | None = None) -> torch.Tensor:
    """x[1, K] @ weight[N, K]^T (+ bias[N]) -> `out` or a new [1, N] tensor, x's dtype (fp32 sums).
    An FP8 weight comes with its fp32 `weight_scale`: [N] (one per row) or, with `block_size`
    (bn, bk), [ceil(N/bn), ceil(K/bk)]; it is dequantized in registers (kernels.fp8). A 16-bit x
    with an fp32 weight (and bias) gives fp32, the same numbers as on x.float(). With `norm` the
    product takes norm.apply(x), formed step by step in registers (`fuses_gated_norm`): the same
    numbers as the norm kernel's output, without its launch and its round trip to memory. With
    `conv`, its columns leave through a decode step of the causal conv (`ConvStep`: its state read
    and written at its pages), the numbers of `causal_conv1d_update` on the stored product. With
    `gate` [1, K], the product of x * torch.sigmoid(gate) (an attention's output gate), each
    rounded as torch rounds it. With `act` (`kernels.activation.fusable`'s (ACT, GATED)), x is
    [1, 2K] (gate | up; [1, K] ungated) and the product takes its activation, the numbers of the
    activation's kernel (an MLP's down projection without that launch)."""
    x_full, x = x, _act_input(x, weight, act)
    _check(x, weight, bias, scale=weight_scale, block=block_size)
    if norm is not None:
        _check_norm(x, norm)
    if gate is not None:
        _check_gate(x, gate, norm)
    if act is not None and (norm is not None or gate is not None):
        raise ValueError("gemv takes an activation without a norm or a gate")
    n, k = weight.shape
    if conv is not None:
        _check_conv(conv, n)
    dtype = _out_dtype(x, weight, weight_scale)
    if out is None:
        out = torch.empty((1, n), dtype=dtype, device=x.device)
    elif tuple(out.shape) != (1, n) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [1, {n}] {dtype} tensor, got {tuple(out.shape)} {out.dtype}")
    if n == 0:
        return out
    if k == 0:
        out.copy_(bias[None] if bias is not None else torch.zeros_like(out))
        return out if conv is None else conv.apply(out)
    x = x_full if x_full.stride(1) == 1 else x_full.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    cfg = dict(config or gemv_config(n, k, weight.element_size()))
    group = 1
    if norm is not None:
        group = norm.group_size
        cfg["BLOCK_K"] = max(cfg["BLOCK_K"], group)
    chunk = check_chunk(cfg)
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else x, out,
        **_scale_args(weight, weight_scale, block_size, cfg["BLOCK_N"]),
        z_ptr=gate if gate is not None else x if norm is None else norm.z,
        nw_ptr=x if norm is None else norm.weight,
        eps=0.0 if norm is None else float(norm.eps), N=n, K=k, stride_wn=weight.stride(0), HAS_BIAS=bias is not None,
        NORM=norm is not None, GROUP=group, NORM_BEFORE_GATE=norm is not None and bool(norm.norm_before_gate),
        ROUND_BEFORE_WEIGHT=norm is not None and bool(norm.round_before_weight), GATE=gate is not None,
        ACT=-1 if act is None else act[0], GATED=act is not None and act[1],
        **_conv_args(conv, x), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], CHUNK=chunk,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **pdl_args(x))
    return out


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
             weight_scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None,
             norm: GatedRMSNorm | None = None, conv: ConvStep | None = None,
             gate: torch.Tensor | None = None, act_and_mul=None) -> torch.Tensor:
    """The same product in fp32 (fp64 for fp64 inputs), rounded once to x's dtype (fp32 for a
    16-bit x with an fp32 weight); with `norm`, of norm.apply(x, ref=True); with `conv`, its
    columns then through `causal_conv1d_update_ref` (the state updated alike); with `gate`, of
    x * torch.sigmoid(gate); with `act_and_mul` (a reference activation), of act_and_mul(x)."""
    if act_and_mul is not None:
        x = act_and_mul(x)
    _check(x, weight, bias, scale=weight_scale, block=block_size)
    if norm is not None:
        _check_norm(x, norm)
        x = norm.apply(x, ref=True)
    if gate is not None:
        _check_gate(x, gate, norm)
        x = x * torch.sigmoid(gate)
    if conv is not None:
        _check_conv(conv, weight.shape[0])
    y = _linear_ref(x, weight, bias, weight_scale, block_size)
    return y if conv is None else conv.apply(y, ref=True)


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    weight_scale: torch.Tensor | None = None,
                    block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """`skinny_gemm`'s product in fp32 (fp64 for fp64 inputs), rounded once to x's dtype."""
    _check(x, weight, bias, _max_rows(weight_scale), scale=weight_scale, block=block_size)
    return _linear_ref(x, weight, bias, weight_scale, block_size)


def _linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = weight.to(acc) if scale is None else dequantize_fp8_ref(weight, scale, block, acc)
    y = F.linear(x.to(acc), w, None if bias is None else bias.to(acc))
    return y.to(_out_dtype(x, weight, scale))


SKINNY_MAX_ROWS = 32  # the tiles below were timed up to 32 rows; F.linear beyond
# FP8 weights: up to 128 rows here, where the alternative (dequantize, then cuBLAS) moves five
# bytes an element instead of one. At 128 rows on an H200 (`kernels.bench.fp8_gemv --rows 128`)
# that holds for wide outputs (gate_up 123 against 174 us) but not for narrow ones, whose
# in-register conversion costs more (down 187 against 94, o_proj 51 against 25); 64 rows untimed.
FP8_SKINNY_MAX_ROWS = 128


def _max_rows(scale: torch.Tensor | None) -> int:
    return SKINNY_MAX_ROWS if scale is None else FP8_SKINNY_MAX_ROWS


def _skinny_block_m(rows: int) -> int:
    """The rows' tile: tl.dot needs 16 at least; few sizes keep the compiled variants few."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, s_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_sn, BN_Q, BK_Q,
                   HAS_BIAS: tl.constexpr, SCALE: tl.constexpr, EVEN: tl.constexpr, SWAP: tl.constexpr,
                   DOT_F32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    # Block scales: the program's rows and each K step lie in one block, whose scale multiplies
    # that step's product (FP8 values become x's dtype exactly, so the product is unchanged).
    s_row = s_ptr + (pid * BLOCK_N // BN_Q) * stride_sn
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        if EVEN:  # N and K are whole tiles: only the padding rows of x are masked
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + kk[None, :])
        else:
            k_ok = kk < K
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if SCALE != SCALE_NONE:
            w = w.to(x_ptr.dtype.element_ty)
        if DOT_F32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if SCALE == SCALE_BLOCK:
            s = tl.load(s_row + k // BK_Q)
            if SWAP:
                acc += tl.dot(w, tl.trans(x), input_precision=PRECISION) * s
            else:
                acc += tl.dot(x, tl.trans(w), input_precision=PRECISION) * s
        elif SWAP:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if SWAP:
        acc = tl.trans(acc)
    if SCALE == SCALE_ROW:
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def skinny_config(n: int, k: int, elem_bytes: int = 2, rows: int = 16) -> dict:
    """Tiles from an H200 sweep in CUDA graphs at 8, 16 and 32 rows (kernels/bench/sweep_skinny_gemm.py):
    narrow outputs (o_proj, down_proj: N 3840) want 32 columns and a deep pipeline, wider ones 64
    columns; 4 warps, 256-key steps. Stages are cut to what fits in ~200 KB of shared memory (fp32
    weights take twice the bytes of bf16)."""
    if n <= 4096:
        cfg = {"BLOCK_N": 32, "BLOCK_K": 256, "SWAP": True, "num_warps": 4, "num_stages": 6}
    elif n <= 16384:
        cfg = {"BLOCK_N": 64, "BLOCK_K": 256, "SWAP": True, "num_warps": 4, "num_stages": 4}
    else:
        cfg = {"BLOCK_N": 64, "BLOCK_K": 256, "SWAP": False, "num_warps": 4, "num_stages": 3}
    per_stage = (_skinny_block_m(rows) + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * elem_bytes
    cfg["num_stages"] = max(1, min(cfg["num_stages"], (200 << 10) // per_stage))
    return cfg


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out: torch.Tensor | None = None, config: dict | None = None,
                weight_scale: torch.Tensor | None = None, block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """x[M, K] @ weight[N, K]^T (+ bias[N]) for 1 <= M <= SKINNY_MAX_ROWS -> `out` or a new [M, N]
    tensor, x's dtype (fp32 sums; fp32 inputs multiply in full precision, not TF32). FP8 weights
    with `weight_scale` (and `block_size`) as in `gemv`, up to FP8_SKINNY_MAX_ROWS rows."""
    _check(x, weight, bias, _max_rows(weight_scale), scale=weight_scale, block=block_size)
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a [{m}, {n}] {x.dtype} tensor with contiguous rows, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if n == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    cfg = dict(config or skinny_config(n, k, x.element_size(), m))
    if block_size is not None and config is None:  # one scale per K step
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], block_size[1])
    _skinny_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, bias if bias is not None else x, out, M=m, N=n, K=k, stride_xm=x.stride(0),
        stride_wn=weight.stride(0), stride_ym=out.stride(0),
        **_scale_args(weight, weight_scale, block_size, cfg["BLOCK_N"], cfg["BLOCK_K"]),
        HAS_BIAS=bias is not None, EVEN=(n % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0),
        SWAP=cfg["SWAP"], DOT_F32=_interpreter_bf16(x), PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=_skinny_block_m(m), BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_args(x))
    return out
