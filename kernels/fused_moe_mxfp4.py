"""Routed experts whose weights are MXFP4 (OCP microscaling FP4, gpt-oss's published checkpoints):
the grouped GEMMs of `kernels.fused_moe` reading 4-bit weights and dequantizing them in registers.

A weight [N, K] (rows of outputs, K the reduction) is kept as the checkpoint stores it:
`blocks` [N, K/2] uint8, two e2m1 values a byte (the lower nibble the even element: K index 2j
in bits 0-3, 2j + 1 in bits 4-7), and `scales` [N, K/32] uint8, one E8M0 exponent per 32
consecutive elements along K: w[n, k] = e2m1(nibble) * 2^(scales[n, k // 32] - 127), e2m1 a
sign bit, two exponent bits and one mantissa bit, the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
negatives (`FP4_VALUES`, transformers' table). 4.25 bits an element on the device.

`fused_experts_mxfp4` is `fused_experts` with such weights and gpt-oss's activation (`SwigluOAI`):
the same alignment of the (token, expert) pairs and the sum over k, the weights' tile turned into
bf16 in registers before the tensor-core product. w13 keeps the checkpoint's rows, gate and up
interleaved (row 2j the gate of column j, 2j + 1 its up), so that a tile of w13's rows holds whole
(gate, up) pairs and the first launch applies the activation to its fp32 accumulator, writing
[T*k, I]: two launches and the sum, no activation launch and no [T*k, 2I] buffer. Two ways to
dequantize, a constexpr of the kernel:
`tl.dot_scaled` (bf16 activations, e2m1 weights with their E8M0 scales: Triton lowers it to its
own upcast and a bf16 product on GPUs without FP4 tensor cores, Hopper's included) and "decode"
(the kernel's own: the nibbles decoded with integer ops into float32 bits, times the scale, cast to
the activations' dtype, then `tl.dot`; any dtype, fp32 included; `DISTENGINE_MXFP4_DOT=decode`
picks it for bf16 too). Small batches take neither. Up to `GEMV_MAX_TOKENS` tokens
`_experts_gemv_mxfp4` runs each (token, expert) pair as GEMVs on the CUDA cores, with no alignment
and the sum over k in the down launch: at one token a 16-row tile of the tensor-core path is 15
rows of padding. Beyond, up to TILE_GEMV_MAX_ROWS pairs an expert, the tile GEMVs
(`_moe_mxfp4_tile_gemv_kernel`) take the grouped GEMMs' row tiles of 2 pairs and decode each
weight once for both: most experts serve one to three pairs there, and Hopper has no FP4
products, so the instructions that turn 4-bit weights into numbers bound every way, and upcasting
whole 16-row tiles for the tensor cores costs more than the products on the CUDA cores. Both read
the weights as int32 words of eight elements. With 16-bit activations (`_f16x2_products`, inline
PTX; the tile GEMVs' `_f16x2_decode` and `_f16x2_dots` split it) a word's eight elements become
four float16 pairs through e4m3 (two per conversion instruction) and meet x, rounded to float16
(beyond +-65,504 clamped) and paired in the order the bytes decode, in paired product-adds: each
float16 lane sums the eight products of two words, then float32 takes over. That is 3.0-3.1
instructions a weight, against 6.2-6.7 in float32, which 4-byte activations keep (`_word_dot`).
Under Triton's interpreter the same sums run in its operations. `fused_experts_mxfp4_ref`
dequantizes the experts a batch chose, deinterleaves their gate/up rows and runs
`fused_experts_ref` with `swiglu_oai_and_mul_ref` (the engine's path on CPU and the tests'
oracle).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.activation import swiglu_oai, swiglu_oai_and_mul_ref
from kernels.fused_moe import ROW_BANDS, RowTiles, _sum_over_k, fused_experts_ref, grid_of, row_tiles, tile_of
from kernels.paged_attention import _interpreter_bf16
from kernels.pdl import pdl_args, pdl_wait

__all__ = ["FP4_VALUES", "GEMV_MAX_TOKENS", "MXFP4_BLOCK", "MXFP4Weight", "SwigluOAI", "TILE_GEMV_MAX_ROWS",
           "dequantize_mxfp4", "fused_experts_mxfp4", "fused_experts_mxfp4_ref", "mxfp4_config",
           "mxfp4_gemv_config", "mxfp4_variant_tokens"]

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32  # elements along K that share one scale


@dataclass(frozen=True)
class MXFP4Weight:
    """A stack of MXFP4 weights [E, N, K]: `blocks` [E, N, K/2] and `scales` [E, N, K/32], uint8."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        b, s = self.blocks, self.scales
        if b.dtype != torch.uint8 or s.dtype != torch.uint8:
            raise TypeError(f"MXFP4 blocks and scales must be uint8, got {b.dtype} and {s.dtype}")
        if b.dim() != 3 or s.dim() != 3 or tuple(b.shape[:2]) != tuple(s.shape[:2]) \
                or b.shape[2] != s.shape[2] * MXFP4_BLOCK // 2:
            raise ValueError(f"MXFP4 blocks [E, N, K/2] and scales [E, N, K/{MXFP4_BLOCK}] do not fit: "
                             f"{tuple(b.shape)} and {tuple(s.shape)}")
        if b.stride(-1) != 1 or s.stride(-1) != 1:
            raise ValueError(f"MXFP4 blocks and scales need contiguous rows, got strides {b.stride()}, {s.stride()}")

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, half = self.blocks.shape
        return e, n, 2 * half


@dataclass(frozen=True)
class SwigluOAI:
    """gpt-oss's activation of a (gate, up) pair: g * sigmoid(alpha g) * (u + 1) with g = min(gate,
    limit) and u = clamp(up, -limit, limit) (`kernels.activation.swiglu_oai_and_mul`)."""

    alpha: float
    limit: float


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., N, K/2], scales [..., N, K/32] -> [..., N, K] in `dtype` (exact in bf16, fp32 and
    fp64: an e2m1 value times a power of two)."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    lut = torch.tensor(FP4_VALUES, dtype=wide, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)
    scale = torch.exp2(scales.to(wide) - 127)
    return (values.unflatten(-1, (-1, MXFP4_BLOCK)) * scale[..., None]).flatten(-2).to(dtype)


@triton.jit
def _e8m0_to_float(s):
    """E8M0 bytes -> 2^(s - 127) as float32 (byte 0, 2^-127, a float32 subnormal)."""
    s32 = s.to(tl.uint32)
    return tl.where(s32 == 0, 0x00400000, s32 << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_float(nib):
    """4-bit e2m1 codes (uint32) -> float32. A magnitude m (3 bits) is 0, 0.5 for m = 1, else
    2^(m>>1 - 1) (1 + (m&1)/2): its float32 bits are (m << 22) + (126 << 23) from m = 2 on,
    m * (126 << 23) below."""
    mag = nib & 7
    bits = tl.where(mag >= 2, (mag << 22) + 0x3F000000, mag * 0x3F000000) | ((nib & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_to_float(w, s, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K/2] packed bytes and [BLOCK_N, BLOCK_K/32] E8M0 scales -> [BLOCK_N, BLOCK_K]
    float32."""
    nib = tl.join(w & 0x0F, w >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.uint32)
    scale = tl.broadcast_to(_e8m0_to_float(s)[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)).reshape(BLOCK_N, BLOCK_K)
    return _e2m1_to_float(nib) * scale


@triton.jit
def _store_tile(acc, b_ptr, c_ptr, rw_ptr, expert, rows, row_ok, rn, n_ok, pid_n, N, stride_be, stride_cm, alpha,
                limit, HAS_BIAS: tl.constexpr, MUL_ROUTED: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """A grouped tile's float32 sums [BLOCK_M, BLOCK_N] (+ b[e]) (* rw[rows]) stored to c's rows,
    or with SWIGLU gpt-oss's activation of their (gate, up) column pairs, [BLOCK_M, BLOCK_N / 2]."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + expert * stride_be + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTED:
        acc *= tl.load(rw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    if SWIGLU:
        gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
        out = swiglu_oai(gate, up, alpha, limit)
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :], out.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < N // 2)[None, :])
    else:
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_rows"])  # T*k changes with every prefill's length
def _moe_mxfp4_gemm_kernel(a_ptr, w_ptr, s_ptr, b_ptr, c_ptr, rw_ptr, rows_ptr, bexp_ptr, N, K, num_rows, n_tiles,
                           stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_cm, alpha, limit,
                           A_ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr, MUL_ROUTED: tl.constexpr,
                           SWIGLU: tl.constexpr, SCALED_DOT: tl.constexpr, PAIR_TILES: tl.constexpr,
                           DOT_F32: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of c[rows] = a[rows // A_ROW_DIV] @ w[e]^T (+ b[e]) (* rw[rows])
    for the tile's expert e, w[e] MXFP4 (K a multiple of 32). With SWIGLU the tile's columns are
    (gate, up) pairs and [BLOCK_M, BLOCK_N / 2] of gpt-oss's activation of them is written."""
    pdl_wait(PDL)
    expert, rows, row_ok, pid_n, rn, n_ok = tile_of(rows_ptr, bexp_ptr, num_rows, n_tiles, N, BLOCK_M, BLOCK_N,
                                                    PAIR_TILES)
    if expert < 0:
        return
    rk = tl.arange(0, BLOCK_K)
    rb = tl.arange(0, BLOCK_K // 2)
    rs = tl.arange(0, BLOCK_K // 32)
    a_rows = a_ptr + (rows // A_ROW_DIV).to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + expert * stride_we + rn.to(tl.int64) * stride_wn
    s_rows = s_ptr + expert * stride_se + rn.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + rk
        a = tl.load(a_rows + kk[None, :], mask=row_ok[:, None] & (kk < K)[None, :], other=0.0)
        kb = k // 2 + rb
        ks = k // 32 + rs
        s = tl.load(s_rows[:, None] + ks[None, :], mask=n_ok[:, None] & (ks < K // 32)[None, :], other=127)
        if SCALED_DOT:  # the weights as the product's [K/2, N] right operand
            w = tl.load(w_rows[None, :] + kb[:, None], mask=n_ok[None, :] & (kb < K // 2)[:, None], other=0)
            acc = tl.dot_scaled(a, None, "bf16", w, s, "e2m1", acc, fast_math=True)  # (no E8M0 NaN checks)
        else:
            w = tl.load(w_rows[:, None] + kb[None, :], mask=n_ok[:, None] & (kb < K // 2)[None, :], other=0)
            wf = _mxfp4_to_float(w, s, BLOCK_N, BLOCK_K)
            if DOT_F32:
                a = a.to(tl.float32)
            else:
                wf = wf.to(a.dtype)
            acc = tl.dot(a, tl.trans(wf), acc, input_precision=PRECISION)
    _store_tile(acc, b_ptr, c_ptr, rw_ptr, expert, rows, row_ok, rn, n_ok, pid_n, N, stride_be, stride_cm, alpha,
                limit, HAS_BIAS, MUL_ROUTED, SWIGLU, BLOCK_M, BLOCK_N)


# A word's eight nibbles as e4m3 bytes s00eem00 (an e2m1 value times 2^-6, its subnormals
# included; `cvt.rn.f16x2.e4m3x2` turns two into a float16 pair in one instruction): the low
# nibbles of the four bytes in `e`, the high ones in `o`. A half of e or o holds two elements two
# apart, so x's pairs are taken in that order (`_x_pairs`) and no byte permute is needed.
_E4M3_BYTES = """shl.b32 t, {w}, 2;
and.b32 e, t, 0x1C1C1C1C;
shl.b32 t, {w}, 4;
and.b32 t, t, 0x80808080;
or.b32 e, e, t;
shr.u32 t, {w}, 2;
and.b32 o, t, 0x1C1C1C1C;
and.b32 t, {w}, 0x80808080;
or.b32 o, o, t;
mov.b32 {{e0, e1}}, e;
mov.b32 {{o0, o1}}, o;
"""
_PAIR_FMA = "cvt.rn.f16x2.e4m3x2 h, {b};\n{op} acc, h, {x}{acc};\n"


def _f16x2_products_ptx() -> str:
    """Sixteen products of two words (Hopper's HFMA2: two a lane-wide instruction). Each lane
    sums its eight products in float16 (at most 8 x 6 x 2^-6 x 65,504, finite); the two lanes are
    added in float32."""
    body = []
    for word, xs in (("$1", (3, 4, 5, 6)), ("$2", (7, 8, 9, 10))):
        body.append(_E4M3_BYTES.format(w=word))
        for b, x in zip(("e0", "e1", "o0", "o1"), xs):
            first = not body[1:]
            body.append(_PAIR_FMA.format(b=b, op="mul.rn.f16x2" if first else "fma.rn.f16x2", x=f"${x}",
                                         acc="" if first else ", acc"))
    return ("{\n.reg .b32 t, e, o, h, acc;\n.reg .b16 e0, e1, o0, o1, al, ah;\n.reg .f32 fl, fh;\n" + "".join(body)
            + "mov.b32 {al, ah}, acc;\ncvt.f32.f16 fl, al;\ncvt.f32.f16 fh, ah;\nadd.f32 $0, fl, fh;\n}")


_F16X2_PRODUCTS = tl.constexpr(_f16x2_products_ptx())
_F16X2_PRODUCTS_ARGS = tl.constexpr("=f" + ",r" * 10)  # a float32 out; two words and eight pairs in
_F16X2_OF = tl.constexpr("cvt.rn.satfinite.f16x2.f32 $0, $2, $1;")
F16_SCALE = tl.constexpr(64.0)  # `_f16x2_products` multiplies by e2m1 values times 2^-6

# The same products with the decode apart, for tiles whose weights meet several activation rows:
# a word's four float16 pairs (`_E4M3_BYTES` then four conversions), decoded once a tile, and the
# sixteen products of two decoded words with one row's pairs.
_F16X2_DECODE = tl.constexpr("{\n.reg .b32 t, e, o;\n.reg .b16 e0, e1, o0, o1;\n" + _E4M3_BYTES.format(w="$4")
                             + "".join(f"cvt.rn.f16x2.e4m3x2 ${i}, {b};\n"
                                       for i, b in enumerate(("e0", "e1", "o0", "o1"))) + "}")
_F16X2_DOTS = tl.constexpr("{\n.reg .b32 acc;\n.reg .b16 al, ah;\n.reg .f32 fl, fh;\nmul.rn.f16x2 acc, $1, $9;\n"
                           + "".join(f"fma.rn.f16x2 acc, ${i}, ${i + 8}, acc;\n" for i in range(2, 9))
                           + "mov.b32 {al, ah}, acc;\ncvt.f32.f16 fl, al;\ncvt.f32.f16 fh, ah;\nadd.f32 $0, fl, fh;\n}")


@triton.jit
def _f16_bits(v):
    """float32 -> the bits of float16, saturating at +-65,504 (uint32)."""
    return tl.minimum(tl.maximum(v, -65504.0), 65504.0).to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _f16x2_words(lo, hi, EMULATE: tl.constexpr):
    """float32 (lo, hi) -> their float16 pair as a word (lo in the low half), saturating at
    +-65,504."""
    if EMULATE:
        return _f16_bits(lo) | (_f16_bits(hi) << 16)
    else:
        return tl.inline_asm_elementwise(_F16X2_OF, "=r,f,f", [lo, hi], dtype=tl.uint32, is_pure=True, pack=1)


@triton.jit
def _x_halves(v, X_F16: tl.constexpr):
    """Words of two 16-bit activations (bf16, or float16 where X_F16) -> (low, high) as float32."""
    if X_F16:
        return _f16x2_to_float(v)
    else:
        return (v << 16).to(tl.float32, bitcast=True), (v & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _x_pairs(xw, SLOTS_P2: tl.constexpr, NW: tl.constexpr, X_F16: tl.constexpr, EMULATE: tl.constexpr):
    """x's words [SLOTS_P2, NW, 4] (two 16-bit elements each, eight a weight word) -> the four
    float16 pairs a weight word meets in `_F16X2_PRODUCTS`, elements (0, 2), (4, 6), (1, 3),
    (5, 7), each [SLOTS_P2, NW]."""
    b0145, b2367 = tl.split(tl.reshape(xw, [SLOTS_P2, NW, 2, 2]))
    b01, b45 = tl.split(b0145)
    b23, b67 = tl.split(b2367)
    x0, x1 = _x_halves(b01, X_F16)
    x2, x3 = _x_halves(b23, X_F16)
    x4, x5 = _x_halves(b45, X_F16)
    x6, x7 = _x_halves(b67, X_F16)
    return (_f16x2_words(x0, x2, EMULATE), _f16x2_words(x4, x6, EMULATE), _f16x2_words(x1, x3, EMULATE),
            _f16x2_words(x5, x7, EMULATE))


@triton.jit
def _word_halves(v, SLOTS_P2: tl.constexpr, NW: tl.constexpr):
    """[SLOTS_P2, NW] -> its even and odd columns, each [SLOTS_P2, 1, NW / 2] (a weight tile's
    rows broadcast)."""
    even, odd = tl.split(tl.reshape(v, [SLOTS_P2, NW // 2, 2]))
    return even[:, None, :], odd[:, None, :]


@triton.jit
def _x_step_pairs(x_rows, kw, rows_ok, k_ok, ROWS: tl.constexpr, NW: tl.constexpr, EMULATE: tl.constexpr):
    """A K step's activations for `_F16X2_PRODUCTS`: rows `x_rows` (16-bit, starting on 16 bytes),
    weight words `kw` -> the pairs (p0..p3) of the even words and (q0..q3) of the odd ones, each
    [ROWS, 1, NW / 2]."""
    X_F16: tl.constexpr = x_rows.dtype.element_ty == tl.float16
    x_words = x_rows.to(tl.pointer_type(tl.uint32))  # two activations a word
    xw = tl.load(x_words[:, None, None] + kw[None, :, None] * 4 + tl.arange(0, 4)[None, None, :],
                 mask=rows_ok[:, None, None] & k_ok[None, :, None], other=0)
    p0, p1, p2, p3 = _x_pairs(xw, ROWS, NW, X_F16, EMULATE)
    p0, q0 = _word_halves(p0, ROWS, NW)
    p1, q1 = _word_halves(p1, ROWS, NW)
    p2, q2 = _word_halves(p2, ROWS, NW)
    p3, q3 = _word_halves(p3, ROWS, NW)
    return p0, p1, p2, p3, q0, q1, q2, q3


@triton.jit
def _f16_pair_fma(w, FIRST: tl.constexpr, xq, lo, hi):
    """The interpreter's form of one float16 product-add of `_F16X2_PRODUCTS`: elements (FIRST,
    FIRST + 2) of words w times the float16 pair xq, added to the lanes (lo, hi) and rounded to
    float16."""
    x_lo, x_hi = _f16x2_to_float(xq)
    lo = (_e2m1_to_float((w >> (4 * FIRST)) & 0xF) * 0.015625 * x_lo + lo).to(tl.float16).to(tl.float32)
    hi = (_e2m1_to_float((w >> (4 * FIRST + 8)) & 0xF) * 0.015625 * x_hi + hi).to(tl.float16).to(tl.float32)
    return lo, hi


@triton.jit
def _f16x2_products(w0, w1, p0, p1, p2, p3, q0, q1, q2, q3, EMULATE: tl.constexpr):
    """sum_c e2m1(element c of words w0 and w1) * 2^-6 * x[c] as float32, x as float16 pairs (p
    for w0, q for w1, in `_x_pairs`' order): `_F16X2_PRODUCTS`, or under the interpreter the same
    sums in Triton's operations."""
    if EMULATE:
        lo = tl.zeros(w0.shape, tl.float32)
        hi = tl.zeros(w0.shape, tl.float32)
        lo, hi = _f16_pair_fma(w0, 0, p0, lo, hi)
        lo, hi = _f16_pair_fma(w0, 4, p1, lo, hi)
        lo, hi = _f16_pair_fma(w0, 1, p2, lo, hi)
        lo, hi = _f16_pair_fma(w0, 5, p3, lo, hi)
        lo, hi = _f16_pair_fma(w1, 0, q0, lo, hi)
        lo, hi = _f16_pair_fma(w1, 4, q1, lo, hi)
        lo, hi = _f16_pair_fma(w1, 1, q2, lo, hi)
        lo, hi = _f16_pair_fma(w1, 5, q3, lo, hi)
        return lo + hi
    else:
        return tl.inline_asm_elementwise(_F16X2_PRODUCTS, _F16X2_PRODUCTS_ARGS,
                                         [w0, w1, p0, p1, p2, p3, q0, q1, q2, q3], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _f16x2_to_float(v):
    """The two float16 halves of int32 words -> (low, high) as float32."""
    return ((v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32),
            ((v >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _word_dot(w, x_rows, kw, x_ok):
    """sum_c e2m1(element c of word w) * x[8 kw + c] in float32 over the eight 4-bit elements of
    int32 words w [SLOTS, BLOCK_N, W] (bytes b0..b3, low nibble first: elements 0..7), each e2m1
    value scaled by 2^-14, x_rows [SLOTS] each slot's activation row. A nibble s|eem is the
    float16 s << 15 | eem << 9 (e2m1 is a float16 with two exponent bits, its subnormals
    included), and two of them are made at once in one word's two halves: the low nibbles of b0
    and b2, of b1 and b3, the high ones likewise. For 4-byte activations, whose precision float16
    products would lose."""
    v04 = ((w & 0x00070007) << 9) | ((w & 0x00080008) << 12)
    v26 = ((w & 0x07000700) << 1) | ((w & 0x08000800) << 4)
    v15 = ((w & 0x00700070) << 5) | ((w & 0x00800080) << 8)
    v37 = ((w >> 3) & 0x0E000E00) | (w & 0x80008000)
    x0 = x_rows[:, None, None] + 8 * kw[None, None, :]
    e0, e4 = _f16x2_to_float(v04)
    acc = e0 * tl.load(x0, mask=x_ok, other=0.0).to(tl.float32)
    acc += e4 * tl.load(x0 + 4, mask=x_ok, other=0.0).to(tl.float32)
    e2, e6 = _f16x2_to_float(v26)
    acc += e2 * tl.load(x0 + 2, mask=x_ok, other=0.0).to(tl.float32)
    acc += e6 * tl.load(x0 + 6, mask=x_ok, other=0.0).to(tl.float32)
    e1, e5 = _f16x2_to_float(v15)
    acc += e1 * tl.load(x0 + 1, mask=x_ok, other=0.0).to(tl.float32)
    acc += e5 * tl.load(x0 + 5, mask=x_ok, other=0.0).to(tl.float32)
    e3, e7 = _f16x2_to_float(v37)
    acc += e3 * tl.load(x0 + 3, mask=x_ok, other=0.0).to(tl.float32)
    acc += e7 * tl.load(x0 + 7, mask=x_ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _weight_words(w_rows, w_ok, kw0, KW, NW: tl.constexpr):
    """Words kw0 .. kw0 + NW of each row in `w_rows` [SLOTS_P2, BLOCK_N] (uint32 [SLOTS_P2,
    BLOCK_N, NW], 0 past KW or where not w_ok); the rows start on 16-byte boundaries, so each
    thread reads four words at once."""
    kw = tl.max_contiguous(tl.multiple_of(kw0 + tl.arange(0, NW), NW), NW)
    return tl.load(w_rows[:, :, None] + kw[None, None, :], mask=w_ok & (kw < KW)[None, None, :], other=0).to(
        tl.uint32, bitcast=True)


@triton.jit
def _mxfp4_rows_dot(x_rows, w_rows, s_rows, w, slot_ok, n_ok, KW, SLOTS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, F16: tl.constexpr, EMULATE: tl.constexpr):
    """w[rows] @ x for BLOCK_N rows of each slot's MXFP4 weight (`w_rows` [SLOTS_P2, BLOCK_N]
    their blocks as int32 words, KW words a row, `s_rows` their scales; `w` their first step's
    words, read by the caller) and the slot's activation row (`x_rows` [SLOTS_P2]), float32
    [SLOTS_P2, BLOCK_N]: no tensor cores, every weight decoded once. All slots' tiles are read in
    one step, so that a program's loads do not wait on each other. F16: the products in float16
    pairs (`_f16x2_products`, x rounded to float16); otherwise in float32 (`_word_dot`)."""
    NW: tl.constexpr = BLOCK_K // 8
    NB: tl.constexpr = BLOCK_K // 32
    rw = tl.arange(0, NW)
    rb = tl.arange(0, NB)
    w_ok = slot_ok[:, None, None] & n_ok[None, :, None]
    acc = tl.zeros([SLOTS_P2, BLOCK_N, NB], tl.float32)
    for kw0 in range(0, KW, NW):
        kw = tl.max_contiguous(tl.multiple_of(kw0 + rw, NW), NW)
        k_ok = kw < KW
        if F16:
            p0, p1, p2, p3, q0, q1, q2, q3 = _x_step_pairs(x_rows, kw, slot_ok, k_ok, SLOTS_P2, NW, EMULATE)
            w0, w1 = tl.split(tl.reshape(w, [SLOTS_P2, BLOCK_N, NW // 2, 2]))
            part = _f16x2_products(w0, w1, p0, p1, p2, p3, q0, q1, q2, q3, EMULATE)
            part = tl.reshape(part, [SLOTS_P2, BLOCK_N, NB, 2])  # two words a product call, 4 a block
        else:
            part = tl.reshape(_word_dot(w, x_rows, kw, slot_ok[:, None, None] & k_ok[None, None, :]),
                              [SLOTS_P2, BLOCK_N, NB, 4])
        kb = kw0 // 4 + rb
        scale = _e8m0_to_float(tl.load(s_rows[:, :, None] + kb[None, None, :],
                                       mask=w_ok & (kb < KW // 4)[None, None, :], other=127))
        acc += tl.sum(part, 3) * scale
        w = _weight_words(w_rows, w_ok, kw0 + NW, KW, NW)
    return tl.sum(acc, 2) * (F16_SCALE if F16 else 16384.0)  # (2^14: `_word_dot`)


@triton.jit
def _moe_mxfp4_gemv_kernel(a_ptr, w_ptr, s_ptr, b_ptr, c_ptr, rw_ptr, ids_ptr, N, K, stride_am, stride_we,
                           stride_wn, stride_se, stride_sn, stride_be, stride_cm, alpha, limit,
                           SLOTS: tl.constexpr, SLOTS_P2: tl.constexpr, A_ROW_DIV: tl.constexpr,
                           HAS_BIAS: tl.constexpr, MUL_ROUTED: tl.constexpr, SWIGLU: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F16: tl.constexpr,
                           IDS_EARLY: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr):
    """BLOCK_N output columns of output row r = program_id(0): the sum over its SLOTS pairs
    p = r * SLOTS + j of a[p // A_ROW_DIV] @ w[e_p]^T (+ b[e_p]) (* rw[p]), e_p = ids[p]. With
    SWIGLU (one slot) the columns are (gate, up) pairs and BLOCK_N / 2 of gpt-oss's activation
    of them are written. w's rows are whole words (stride_wn, stride_we multiples of 4 words).
    IDS_EARLY: ids were written at least two launches back (the down launch after the gate/up
    one), so the ids and the first weight tile are read before the PDL wait (`kernels/pdl.py`)."""
    if not IDS_EARLY:
        pdl_wait(PDL)
    row = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rs = tl.arange(0, SLOTS_P2)
    slot_ok = rs < SLOTS
    pair = row * SLOTS + rs
    expert = tl.load(ids_ptr + pair, mask=slot_ok, other=0).to(tl.int64)
    x_rows = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    # The row offsets as whole words (16 bytes), so that the weight loads are 16-byte vectors.
    w_rows = (w_ptr + tl.multiple_of(expert * stride_we, 4)[:, None]
              + tl.multiple_of(rn * stride_wn, 4).to(tl.int64)[None, :])
    s_rows = s_ptr + expert[:, None] * stride_se + rn.to(tl.int64)[None, :] * stride_sn
    KW = tl.multiple_of(K // 8, 4)  # K is a multiple of 32
    w = _weight_words(w_rows, slot_ok[:, None, None] & n_ok[None, :, None], 0, KW, BLOCK_K // 8)
    if IDS_EARLY:
        pdl_wait(PDL)
    v = _mxfp4_rows_dot(x_rows, w_rows, s_rows, w, slot_ok, n_ok, KW, SLOTS_P2, BLOCK_N, BLOCK_K, F16, EMULATE)
    if HAS_BIAS:
        v += tl.load(b_ptr + expert[:, None] * stride_be + rn[None, :], mask=slot_ok[:, None] & n_ok[None, :],
                     other=0.0).to(tl.float32)
    if MUL_ROUTED:
        v *= tl.load(rw_ptr + pair, mask=slot_ok, other=0.0).to(tl.float32)[:, None]
    y = tl.sum(v, 0)
    out_row = c_ptr + row.to(tl.int64) * stride_cm
    if SWIGLU:
        gate, up = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        cols = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(out_row + cols, swiglu_oai(gate, up, alpha, limit).to(c_ptr.dtype.element_ty), mask=cols < N // 2)
    else:
        tl.store(out_row + rn, y.to(c_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _f16x2_decode(w, EMULATE: tl.constexpr):
    """int32 words of eight e2m1 elements -> their four float16 pairs (elements (0, 2), (4, 6), (1,
    3), (5, 7), each times 2^-6, as `_x_pairs` pairs x): `_F16X2_DECODE`, or the interpreter's
    form of it."""
    if EMULATE:
        return (_f16x2_words(_e2m1_to_float(w & 0xF) * 0.015625, _e2m1_to_float((w >> 8) & 0xF) * 0.015625, True),
                _f16x2_words(_e2m1_to_float((w >> 16) & 0xF) * 0.015625, _e2m1_to_float((w >> 24) & 0xF) * 0.015625,
                             True),
                _f16x2_words(_e2m1_to_float((w >> 4) & 0xF) * 0.015625, _e2m1_to_float((w >> 12) & 0xF) * 0.015625,
                             True),
                _f16x2_words(_e2m1_to_float((w >> 20) & 0xF) * 0.015625, _e2m1_to_float((w >> 28) & 0xF) * 0.015625,
                             True))
    else:
        return tl.inline_asm_elementwise(_F16X2_DECODE, "=r,=r,=r,=r,r", [w], dtype=(tl.uint32,) * 4, is_pure=True,
                                         pack=1)


@triton.jit
def _f16_pairs_fma(h, xq, lo, hi):
    """The interpreter's form of one float16 product-add of `_F16X2_DOTS`: the float16 pairs h
    times xq, added to the lanes (lo, hi) and rounded to float16."""
    h_lo, h_hi = _f16x2_to_float(h)
    x_lo, x_hi = _f16x2_to_float(xq)
    return (h_lo * x_lo + lo).to(tl.float16).to(tl.float32), (h_hi * x_hi + hi).to(tl.float16).to(tl.float32)


@triton.jit
def _f16x2_dots(h0, h1, h2, h3, g0, g1, g2, g3, p0, p1, p2, p3, q0, q1, q2, q3, EMULATE: tl.constexpr):
    """`_f16x2_products` of two decoded words (h, g: `_f16x2_decode`) and a row's pairs (p, q)."""
    if EMULATE:
        lo = tl.zeros(p0.shape, tl.float32) + tl.zeros(h0.shape, tl.float32)
        hi = lo
        lo, hi = _f16_pairs_fma(h0, p0, lo, hi)
        lo, hi = _f16_pairs_fma(h1, p1, lo, hi)
        lo, hi = _f16_pairs_fma(h2, p2, lo, hi)
        lo, hi = _f16_pairs_fma(h3, p3, lo, hi)
        lo, hi = _f16_pairs_fma(g0, q0, lo, hi)
        lo, hi = _f16_pairs_fma(g1, q1, lo, hi)
        lo, hi = _f16_pairs_fma(g2, q2, lo, hi)
        lo, hi = _f16_pairs_fma(g3, q3, lo, hi)
        return lo + hi
    else:
        return tl.inline_asm_elementwise(_F16X2_DOTS, "=f" + ",r" * 16,
                                         [h0, h1, h2, h3, g0, g1, g2, g3, p0, p1, p2, p3, q0, q1, q2, q3],
                                         dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _mxfp4_tile_dot(x_rows, w_rows, s_rows, row_ok, n_ok, KW, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    """x[rows] @ w^T for one expert's BLOCK_N rows (`w_rows` [BLOCK_N] their blocks as int32 words,
    KW words a row; `s_rows` their scales) and BLOCK_M activation rows (`x_rows`, 16-bit): float32
    [BLOCK_M, BLOCK_N], each weight read and decoded once for all the rows, products in float16
    pairs as `_mxfp4_rows_dot`'s."""
    NW: tl.constexpr = BLOCK_K // 8
    NB: tl.constexpr = BLOCK_K // 32
    rw = tl.arange(0, NW)
    rb = tl.arange(0, NB)
    acc = tl.zeros([BLOCK_M, BLOCK_N, NB], tl.float32)
    for kw0 in range(0, KW, NW):
        kw = tl.max_contiguous(tl.multiple_of(kw0 + rw, NW), NW)
        k_ok = kw < KW
        w = tl.load(w_rows[None, :, None] + kw[None, None, :], mask=n_ok[None, :, None] & k_ok[None, None, :],
                    other=0).to(tl.uint32, bitcast=True)
        p0, p1, p2, p3, q0, q1, q2, q3 = _x_step_pairs(x_rows, kw, row_ok, k_ok, BLOCK_M, NW, EMULATE)
        w0, w1 = tl.split(tl.reshape(w, [1, BLOCK_N, NW // 2, 2]))
        h0, h1, h2, h3 = _f16x2_decode(w0, EMULATE)
        g0, g1, g2, g3 = _f16x2_decode(w1, EMULATE)
        part = _f16x2_dots(h0, h1, h2, h3, g0, g1, g2, g3, p0, p1, p2, p3, q0, q1, q2, q3, EMULATE)
        part = tl.reshape(part, [BLOCK_M, BLOCK_N, NB, 2])  # two words a product call, 4 a block
        kb = kw0 // 4 + rb
        scale = _e8m0_to_float(tl.load(s_rows[None, :, None] + kb[None, None, :],
                                       mask=n_ok[None, :, None] & (kb < KW // 4)[None, None, :], other=127))
        acc += tl.sum(part, 3) * scale
    return tl.sum(acc, 2) * F16_SCALE


@triton.jit(do_not_specialize=["num_rows"])
def _moe_mxfp4_tile_gemv_kernel(a_ptr, w_ptr, s_ptr, b_ptr, c_ptr, rw_ptr, rows_ptr, bexp_ptr, N, K, num_rows,
                                n_tiles, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_cm,
                                alpha, limit, A_ROW_DIV: tl.constexpr, HAS_BIAS: tl.constexpr,
                                MUL_ROUTED: tl.constexpr, SWIGLU: tl.constexpr, PAIR_TILES: tl.constexpr,
                                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                EMULATE: tl.constexpr, PDL: tl.constexpr):
    """`_moe_mxfp4_gemm_kernel`'s tile (its rows from `moe_align`, one expert) on the CUDA cores:
    the expert's BLOCK_N weight rows decoded once into float16 pairs and multiplied with each of
    the tile's BLOCK_M activation rows (`_mxfp4_tile_dot`). 16-bit activations; w's rows whole
    words (stride_wn, stride_we multiples of 4 words)."""
    pdl_wait(PDL)
    expert, rows, row_ok, pid_n, rn, n_ok = tile_of(rows_ptr, bexp_ptr, num_rows, n_tiles, N, BLOCK_M, BLOCK_N,
                                                    PAIR_TILES)
    if expert < 0:
        return
    x_rows = a_ptr + (rows // A_ROW_DIV).to(tl.int64) * stride_am
    w_rows = w_ptr + tl.multiple_of(expert * stride_we, 4) + tl.multiple_of(rn * stride_wn, 4).to(tl.int64)
    s_rows = s_ptr + expert * stride_se + rn.to(tl.int64) * stride_sn
    acc = _mxfp4_tile_dot(x_rows, w_rows, s_rows, row_ok, n_ok, tl.multiple_of(K // 8, 4), BLOCK_M, BLOCK_N, BLOCK_K,
                          EMULATE)
    _store_tile(acc, b_ptr, c_ptr, rw_ptr, expert, rows, row_ok, rn, n_ok, pid_n, N, stride_be, stride_cm, alpha,
                limit, HAS_BIAS, MUL_ROUTED, SWIGLU, BLOCK_M, BLOCK_N)


# Up to this many pairs an expert (on average) 16-bit activations take the tile GEMVs
# (`_moe_mxfp4_tile_gemv_kernel`) beyond GEMV_MAX_TOKENS tokens. gpt-oss-120b's experts on one
# H200 (128 experts, 4 a token: 2 pairs an expert at 64 tokens), CUDA graphs, cold L2, us, the
# tile GEMVs' tiles (2 rows, 64 weight rows x 256 keys on 2 warps: the fastest of 36 at 32 to 128
# tokens) against `tl.dot_scaled`'s grouped GEMMs in the same call: 32 / 48 / 64 tokens 439.3 /
# 579.0 / 729.1 against 622.1 / 736.5 / 849.8, but 96 / 128 tokens 973.7 / 1,242.6 against 908.8
# / 939.6. Tiles of 4 or 8 rows were slower at every point (128 tokens, 4 rows: 1,260.5).
TILE_GEMV_MAX_ROWS = 2


def mxfp4_config(num_pairs: int, num_experts: int, itemsize: int = 2, tile_gemv: bool = True) -> dict:
    """Tiles by the rows each expert gets (pairs / E), in `moe_config`'s bands: up to
    TILE_GEMV_MAX_ROWS with 16-bit activations the tile GEMVs ("TILE_GEMV", unless `tile_gemv` is
    False: the grouped GEMMs' tiles for the same batch); a decode step's tiles are mostly padding
    rows, so 16-row tiles. Prefill steps (over 64 rows an expert) 128 x 128 tiles: 8 warps
    dequantize a 128 x 128 weight tile (the upcast runs once per tile of rows, so larger row tiles
    amortise it). 4-byte activations (fp32 tests) keep 64 x 64 x 64 tiles past 24 rows, whose
    stages and decoded fp32 weight tile fit in shared memory."""
    rows = num_pairs / num_experts
    if tile_gemv and itemsize == 2 and rows <= TILE_GEMV_MAX_ROWS:
        return {"TILE_GEMV": True, "BLOCK_M": 2, "BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 2}
    if rows <= ROW_BANDS[0]:
        # H200 sweep (`kernels.bench.moe_mxfp4 --sweep`), gpt-oss-120b: the upcast, not the bytes,
        # bounds a decode step's experts, and 2-warp programs spread it over more of the SMs. One
        # token (4 experts): 32 weight rows x 128, 68 us against 86 with 64 x 128 on 4 warps; 64
        # tokens (~111 experts): 64 x 64, 895 us against 992 with 32 x 128.
        if num_pairs < num_experts:
            return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 2, "num_stages": 3}
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 2, "num_stages": 3}
    if rows <= ROW_BANDS[1]:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    if itemsize > 2:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    if rows <= ROW_BANDS[2]:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}


# Up to this many tokens the experts run as GEMVs (`_experts_gemv_mxfp4`), one program a pair:
# no alignment launch, no sum launch. gpt-oss-120b's experts on one H200, CUDA graphs, cold L2,
# us (`kernels.bench.moe_mxfp4`): 1 / 16 tokens 31.3 / 257.2 against 75.4 / 397.8 for
# `tl.dot_scaled`'s grouped GEMMs (8 tokens, an earlier call: 138.1 against 239.1). From 16 tokens
# the tile GEMVs are as fast (16: 253.3, the same call) and then faster (`--tile-sweep`, earlier
# calls: 24 tokens 348.1 against 375.9; 32: 439.3 against 491.4; 40: 522.2 against 614.7).
GEMV_MAX_TOKENS = 16


def mxfp4_gemv_config(k: int, slots: int, f16: bool = True, rows: int = 1) -> dict:
    """GEMV tiles of a weight of K columns whose launch sums `slots` pairs into each of its `rows`
    output rows, with float16 products (`f16`) or float32 ones. From the H200 sweeps (gpt-oss-120b,
    `python -m kernels.bench.moe_mxfp4 --gemv-sweep 1 8` and the same sweep at 12 to 40 tokens,
    each launch alone in a CUDA graph; the float16 products as now, two words a product call), us:
    - gate/up, one token (4 pairs): 16 weight rows x 1,024 columns on 4 warps, 20.6-21.2 against
      22.1-22.5 for 8 x 1,024 on one warp, and in gpt-oss-120b's batch-1 decode step 2.136-2.139
      ms against 2.199-2.203 (three rounds of 50 steps each, one call); up to 31 pairs 8 x 1,024
      on one warp (eight tokens 91.6-91.8 against 93.1-93.3 for 16 rows on 4 warps); from 32 pairs
      16 rows on one warp (8 / 12 / 16 tokens 90.7 / 127.8 / 166.6 against 92.3 / 132.0 / 172.3
      for 8 rows);
    - down, which reads a token's k pairs' tiles in one step: 8 rows x 1,024 on 8 warps for one
      token (14.5-14.6, 4 warps 15.3-15.4), 4 warps for more (eight tokens 56.7-56.8 against 62.5;
      the fastest of the sweep or within 0.2% of it from 8 to 16 tokens);
    - a K loop pipelined through shared memory (`tl.range(num_stages=2 or 3)`) did not help one
      token and gained up to 4% at eight; reading each step's tile before the step before is
      multiplied was slower.
    Float32 products: 8 x 1,024 on 4 warps for gate/up (27.4) and 8 for down (21.0)."""
    block_k = min(1024, max(MXFP4_BLOCK, triton.next_power_of_2(k)))
    if not f16:
        return {"BLOCK_N": 8, "BLOCK_K": block_k, "num_warps": 8 if slots > 1 else 4}
    if slots > 1:
        return {"BLOCK_N": 8, "BLOCK_K": block_k, "num_warps": 8 if rows == 1 else 4}
    if rows <= 4:
        return {"BLOCK_N": 16, "BLOCK_K": block_k, "num_warps": 4}
    if rows < 32:
        return {"BLOCK_N": 8, "BLOCK_K": block_k, "num_warps": 1}
    return {"BLOCK_N": 16, "BLOCK_K": block_k, "num_warps": 1}


def mxfp4_variant_tokens(num_experts: int, top_k: int, itemsize: int = 2) -> list[int]:
    """The fewest tokens of each kernel variant that `fused_experts_mxfp4` picks for batches up to
    the tile GEMVs' last (`mxfp4_gemv_config`'s tiles of both GEMV launches, then the tile
    GEMVs'): a batch of each compiles them all."""
    first: dict[str, int] = {}
    t = 1
    while t <= GEMV_MAX_TOKENS or mxfp4_config(t * top_k, num_experts, itemsize).get("TILE_GEMV"):
        if t <= GEMV_MAX_TOKENS:
            f16 = itemsize == 2
            key = repr((mxfp4_gemv_config(0, 1, f16, t * top_k), mxfp4_gemv_config(0, top_k, f16, t)))
        else:
            key = repr(mxfp4_config(t * top_k, num_experts, itemsize))
        first.setdefault(key, t)
        t += 1
    return sorted(first.values())


def _words(w: MXFP4Weight) -> torch.Tensor | None:
    """w's blocks as int32 words of eight elements, None where its rows do not start on 16-byte
    boundaries (the GEMVs read four words at once)."""
    b = w.blocks
    if b.storage_offset() % 16 or b.stride(0) % 16 or b.stride(1) % 16 or b.shape[2] % 16:
        return None
    return b.view(torch.int32)


def _rows_on_16_bytes(a: torch.Tensor) -> torch.Tensor:
    """a, copied where its rows do not start on 16-byte boundaries (the GEMVs read 16-bit
    activations as 16-byte vectors of words)."""
    return a.clone() if a.data_ptr() % 16 or a.stride(0) % 8 else a


def _gemv_mxfp4(a, w: MXFP4Weight, words: torch.Tensor, b, ids, out, routed, slots: int, a_row_div: int,
                act: SwigluOAI | None = None, config: dict | None = None, ids_early: bool = False) -> None:
    """One launch: out[r] = the sum over the pairs p = r * slots + j of a[p // a_row_div] @
    w[ids[p]]^T (+ b) (* routed[p]), or with `act` (one slot) the activation of its (gate, up)
    column pairs; `words` w's blocks (`_words`). 2-byte activations take float16 products (x
    rounded to float16, beyond +-65,504 clamped), 4-byte ones float32 products. `ids_early`: ids
    were written before the launch this one follows (the kernel reads them, and its first weight
    tile, before its PDL wait)."""
    _, n, k = w.shape
    f16 = a.element_size() == 2
    if f16:
        a = _rows_on_16_bytes(a)
    cfg = config or mxfp4_gemv_config(k, slots, f16, out.shape[0])
    if cfg["BLOCK_K"] % MXFP4_BLOCK or (act is not None and cfg["BLOCK_N"] % 2):
        raise ValueError(f"GEMV tiles need BLOCK_K a multiple of {MXFP4_BLOCK} (and an even BLOCK_N with the "
                         f"activation), got {cfg}")
    grid = (out.shape[0], triton.cdiv(n, cfg["BLOCK_N"]))
    _moe_mxfp4_gemv_kernel[grid](
        a, words, w.scales, b if b is not None else a, out, routed if routed is not None else out, ids, n, k,
        a.stride(0), words.stride(0), words.stride(1), w.scales.stride(0), w.scales.stride(1),
        b.stride(0) if b is not None else 0, out.stride(0), act.alpha if act is not None else 0.0,
        act.limit if act is not None else 0.0, SLOTS=slots, SLOTS_P2=triton.next_power_of_2(slots),
        A_ROW_DIV=a_row_div, HAS_BIAS=b is not None, MUL_ROUTED=routed is not None, SWIGLU=act is not None,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], F16=f16, IDS_EARLY=ids_early,
        EMULATE=os.environ.get("TRITON_INTERPRET") == "1", num_warps=cfg["num_warps"], num_stages=1, **pdl_args(a))


def _experts_gemv_mxfp4(x, w13: MXFP4Weight, w2: MXFP4Weight, words13: torch.Tensor, words2: torch.Tensor,
                        topk_weights, topk_ids, act: SwigluOAI, b13, b2) -> torch.Tensor:
    """A few tokens' experts without tensor cores or alignment, two launches: each pair's gate/up
    GEMV with the activation, then each token's down GEMVs summed over its k pairs."""
    t, k = topk_ids.shape
    ids, routed = topk_ids.reshape(-1).contiguous(), topk_weights.reshape(-1).contiguous()
    inter = torch.empty((t * k, w2.shape[2]), dtype=x.dtype, device=x.device)
    _gemv_mxfp4(x, w13, words13, b13, ids, inter, None, 1, k, act)
    out = torch.empty((t, w2.shape[1]), dtype=x.dtype, device=x.device)
    # ids were written before the gate/up launch, which only reads them.
    _gemv_mxfp4(inter, w2, words2, b2, ids, out, routed, k, 1, ids_early=True)
    return out


def _tile_gemv_mxfp4(a, w: MXFP4Weight, words: torch.Tensor, b, tiles: RowTiles, out, routed, a_row_div: int,
                     cfg: dict, act: SwigluOAI | None = None) -> None:
    """One launch of `_moe_mxfp4_tile_gemv_kernel`: `_grouped_gemm_mxfp4`'s sums (16-bit `a`)
    with each weight decoded once for the tile's rows, products on the CUDA cores."""
    _, n, k = w.shape
    if a.element_size() != 2:
        raise TypeError(f"the tile GEMVs take 16-bit activations, got {a.dtype}")
    a = _rows_on_16_bytes(a)
    block_k = min(cfg["BLOCK_K"], max(MXFP4_BLOCK, triton.next_power_of_2(k)))
    if block_k % MXFP4_BLOCK or (act is not None and cfg["BLOCK_N"] % 2):
        raise ValueError(f"tile GEMVs need BLOCK_K a multiple of {MXFP4_BLOCK} (and an even BLOCK_N with the "
                         f"activation), got {cfg}")
    grid, n_tiles = grid_of(tiles, n, cfg["BLOCK_N"])
    _moe_mxfp4_tile_gemv_kernel[grid](
        a, words, w.scales, b if b is not None else a, out, routed if routed is not None else out, tiles.rows,
        tiles.block_expert, n, k, out.shape[0], n_tiles, a.stride(0), words.stride(0), words.stride(1),
        w.scales.stride(0), w.scales.stride(1), b.stride(0) if b is not None else 0, out.stride(0),
        act.alpha if act is not None else 0.0, act.limit if act is not None else 0.0, A_ROW_DIV=a_row_div,
        HAS_BIAS=b is not None, MUL_ROUTED=routed is not None, SWIGLU=act is not None,
        PAIR_TILES=tiles.pair_tiles, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k,
        EMULATE=os.environ.get("TRITON_INTERPRET") == "1", num_warps=cfg["num_warps"], num_stages=1, **pdl_args(a))


def _use_scaled_dot(x: torch.Tensor, scaled_dot: bool | None) -> bool:
    """`tl.dot_scaled` for bf16 activations unless DISTENGINE_MXFP4_DOT=decode (for comparisons)."""
    if scaled_dot is None:
        return x.dtype == torch.bfloat16 and os.environ.get("DISTENGINE_MXFP4_DOT", "scaled") != "decode"
    if scaled_dot and x.dtype != torch.bfloat16:
        raise TypeError(f"tl.dot_scaled takes bf16 activations here, got {x.dtype}")
    return scaled_dot


def _grouped_gemm_mxfp4(a, w: MXFP4Weight, b, tiles: RowTiles, out, routed, a_row_div: int, cfg: dict,
                        scaled_dot: bool, act: SwigluOAI | None = None) -> None:
    """One launch: out[rows] = a[rows // a_row_div] @ w[e]^T (+ b) (* routed), or with `act` the
    activation of its (gate, up) column pairs (out [rows, N / 2])."""
    _, n, k = w.shape
    if cfg["BLOCK_K"] % MXFP4_BLOCK:
        raise ValueError(f"BLOCK_K must be a multiple of {MXFP4_BLOCK}, got {cfg['BLOCK_K']}")
    if act is not None and (routed is not None or n % 2):
        raise ValueError("the fused activation takes (gate, up) row pairs and no routing weights")
    grid, n_tiles = grid_of(tiles, n, cfg["BLOCK_N"])
    _moe_mxfp4_gemm_kernel[grid](
        a, w.blocks, w.scales, b if b is not None else a, out, routed if routed is not None else out, tiles.rows,
        tiles.block_expert, n, k, out.shape[0], n_tiles, a.stride(0), w.blocks.stride(0), w.blocks.stride(1),
        w.scales.stride(0), w.scales.stride(1), b.stride(0) if b is not None else 0, out.stride(0),
        act.alpha if act is not None else 0.0, act.limit if act is not None else 0.0, A_ROW_DIV=a_row_div,
        HAS_BIAS=b is not None, MUL_ROUTED=routed is not None, SWIGLU=act is not None, SCALED_DOT=scaled_dot,
        PAIR_TILES=tiles.pair_tiles,
        DOT_F32=_interpreter_bf16(a), PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_args(a))


def _check(x, w13: MXFP4Weight, w2: MXFP4Weight, topk_weights, topk_ids, b13, b2) -> None:
    if not isinstance(w13, MXFP4Weight) or not isinstance(w2, MXFP4Weight):
        raise TypeError("w13 and w2 must be MXFP4Weight (blocks and scales)")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got {tuple(x.shape)}")
    e, two_i, h = w13.shape
    if h != x.shape[1] or tuple(w2.shape[:2]) != (e, h) or two_i != 2 * w2.shape[2]:
        raise ValueError(f"expert shapes do not fit: x {tuple(x.shape)}, w13 {w13.shape} (want [E, 2I, "
                         f"{x.shape[1]}]), w2 {w2.shape} (want [{e}, {h}, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must both be [{x.shape[0]}, k], got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if b13 is not None and tuple(b13.shape) != (e, two_i) or b2 is not None and tuple(b2.shape) != (e, h):
        raise ValueError(f"biases must be [{e}, {two_i}] and [{e}, {h}]")


def fused_experts_mxfp4(x: torch.Tensor, w13: MXFP4Weight, w2: MXFP4Weight, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, act: SwigluOAI, b13: torch.Tensor | None = None,
                        b2: torch.Tensor | None = None, config: dict | None = None,
                        scaled_dot: bool | None = None) -> torch.Tensor:
    """`fused_experts` with MXFP4 w13 [E, 2I, H] (gate and up rows interleaved, as gpt-oss's
    checkpoints) and w2 [E, H, I] (H and I multiples of 32), gpt-oss's activation `act`; biases
    in x's dtype (b13 interleaved as w13's rows). Without `config`, up to GEMV_MAX_TOKENS tokens
    run as GEMVs, then `mxfp4_config`'s tiles: the tile GEMVs for few pairs an expert, else the
    grouped GEMMs, where `scaled_dot` (default: for bf16 x) picks `tl.dot_scaled` over the
    kernel's own decode. Blocks whose rows do not start on 16-byte boundaries take the grouped
    GEMMs."""
    _check(x, w13, w2, topk_weights, topk_ids, b13, b2)
    use_scaled = _use_scaled_dot(x, scaled_dot)
    t, k = topk_ids.shape
    e, two_i, h = w13.shape
    if t == 0:
        return x.new_zeros((0, h))
    x = x if x.stride(1) == 1 else x.contiguous()
    words13, words2 = _words(w13), _words(w2)
    as_words = words13 is not None and words2 is not None
    if config is None and t <= GEMV_MAX_TOKENS and as_words:
        return _experts_gemv_mxfp4(x, w13, w2, words13, words2, topk_weights, topk_ids, act, b13, b2)
    cfg = config or mxfp4_config(t * k, e, x.element_size(), tile_gemv=as_words)
    if cfg.get("TILE_GEMV") and not as_words:
        raise ValueError("the tile GEMVs read the blocks as words: their rows must start on 16-byte boundaries")
    # A tile a pair at batch 1 (no alignment launch) measured slower here: gpt-oss-120b's decode
    # step 4.01 against 3.88 ms (one H200, the same call), where the bf16 experts gained.
    tiles = row_tiles(topk_ids, e, cfg["BLOCK_M"], pair_tiles=False)
    routed = topk_weights.reshape(-1).contiguous()
    inter = torch.empty((t * k, two_i // 2), dtype=x.dtype, device=x.device)
    out = torch.empty((t * k, h), dtype=x.dtype, device=x.device)
    if cfg.get("TILE_GEMV"):
        _tile_gemv_mxfp4(x, w13, words13, b13, tiles, inter, None, k, cfg, act)
        _tile_gemv_mxfp4(inter, w2, words2, b2, tiles, out, routed, 1, cfg)
    else:
        _grouped_gemm_mxfp4(x, w13, b13, tiles, inter, None, k, cfg, use_scaled, act)
        _grouped_gemm_mxfp4(inter, w2, b2, tiles, out, routed, 1, cfg, use_scaled)
    return _sum_over_k(out, t, k)


def _halves(t: torch.Tensor) -> torch.Tensor:
    """Rows [g0 u0 g1 u1 ...] -> [g0 g1 ... u0 u1 ...] (dim 1)."""
    return torch.cat([t[:, 0::2], t[:, 1::2]], dim=1)


def fused_experts_mxfp4_ref(x: torch.Tensor, w13: MXFP4Weight, w2: MXFP4Weight, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor, act: SwigluOAI, b13: torch.Tensor | None = None,
                            b2: torch.Tensor | None = None) -> torch.Tensor:
    """The experts that some token chose, dequantized to x's dtype (exactly), their gate/up rows
    deinterleaved, through `fused_experts_ref` and `swiglu_oai_and_mul_ref`."""
    _check(x, w13, w2, topk_weights, topk_ids, b13, b2)
    used, ids = torch.unique(topk_ids, return_inverse=True)
    gate_up = _halves(dequantize_mxfp4(w13.blocks[used], w13.scales[used], x.dtype))
    down = dequantize_mxfp4(w2.blocks[used], w2.scales[used], x.dtype)
    return fused_experts_ref(x, gate_up, down, topk_weights, ids.reshape(topk_ids.shape),
                             lambda h: swiglu_oai_and_mul_ref(h, act.alpha, act.limit),
                             _halves(b13[used]) if b13 is not None else None, b2[used] if b2 is not None else None)
