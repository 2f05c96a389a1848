"""W8A8: y = x W^T (+ b) for an FP8 weight (kernels.fp8: float8_e4m3fn with fp32 scales per row
or per bn x bk block) at decode sizes (1 to W8A8_MAX_ROWS rows of x), on FP8 tensor cores.

The weight-only path (`kernels.gemv` with `weight_scale`) converts every e4m3 weight element to
bf16 in registers before the product; on a Hopper that conversion, not the weight's bytes, bounds
it. Here the weight tile goes to `tl.dot` as stored and x is quantized instead, inside the kernel:
per (row, ACT_GROUP-column group) to e4m3 with the dynamic scale max|x| / 448 (the computation
the published "dynamic activation" checkpoints are made for: DeepSeek / Qwen block FP8,
compressed-tensors FP8_DYNAMIC). Each K step is one group wide per dot, so its product is scaled
once per row (x's scale) and per block (the weight's), accumulated in fp32. x's quantization is
repeated by every program (cdiv(N, BLOCK_N) of them): at M rows it is M * K conversions a
program against the weight tile's BLOCK_N * K bytes, cheap while M <= BLOCK_N.

`quantize_act_ref` is the activation rule (one place); the kernel follows it bit for bit (the
division correctly rounded, fp32 -> e4m3 round-to-nearest-even), and `w8a8_gemm_ref` is the
product in float64 of what the kernel multiplies.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_DTYPE, FP8_MAX, check_fp8_weight, dequantize_fp8_ref
from kernels.pdl import pdl_args, pdl_wait

__all__ = ["ACT_GROUP", "ACT_AMAX_FLOOR", "W8A8_MAX_ROWS", "quantize_act_ref", "w8a8_gemm", "w8a8_gemm_ref",
           "w8a8_config", "w8a8_block_ok"]

ACT_GROUP = 128  # columns of x sharing one dynamic scale (the published block width)
# The smallest amax a group's scale is taken from: an all-zero group (the padding rows, a zero
# activation) quantizes to zeros with a finite scale instead of 0 / 0.
ACT_AMAX_FLOOR = 1e-10
W8A8_MAX_ROWS = 128  # the skinny bound of FP8 weights (kernels.gemv.FP8_SKINNY_MAX_ROWS)

_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(ACT_AMAX_FLOOR)


def quantize_act_ref(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation rule: x[M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/group)]), each
    (row, group)'s scale max(amax, ACT_AMAX_FLOOR) / 448 in fp32 and its values x / scale (fp32,
    correctly rounded), clamped to +-448, rounded to nearest-even e4m3."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    g = triton.cdiv(k, group)
    xf = torch.zeros(m, g * group, dtype=torch.float32, device=x.device)
    xf[:, :k] = x.to(torch.float32)
    amax = xf.view(m, g, group).abs().amax(2)
    scale = amax.clamp(min=ACT_AMAX_FLOOR) / FP8_MAX
    q = (xf.view(m, g, group) / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(m, g * group)[:, :k]
    return q.to(FP8_DTYPE), scale


def w8a8_gemm_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  block_size: tuple[int, int] | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`w8a8_gemm`'s product in float64: x quantized by `quantize_act_ref`, times the FP8
    weight with its scales, plus the bias; an [M, N] float64 tensor (not rounded to x's dtype)."""
    _check(x, weight, weight_scale, block_size, bias)
    xq, xs = quantize_act_ref(x)
    k = x.shape[1]
    xd = xq.double() * xs.double().repeat_interleave(ACT_GROUP, 1)[:, :k]
    wd = dequantize_fp8_ref(weight, weight_scale.double(), block_size, torch.float64)
    y = xd @ wd.t()
    return y if bias is None else y + bias.double()


def w8a8_block_ok(block_size: tuple[int, int] | None) -> bool:
    """Whether the kernel serves a weight scale layout: per row, or blocks whose columns are
    whole activation groups and whose rows are whole 16-row tiles."""
    return block_size is None or (block_size[1] % ACT_GROUP == 0 and block_size[0] % 16 == 0)


@triton.jit
def _round_e4m3(v):
    """Round fp32 `v` (|v| <= 448) to the nearest-even e4m3 value, in fp32: add and take away a
    number whose fp32 spacing is v's e4m3 spacing. Only under the interpreter, whose own
    fp32 -> e4m3 conversion drops the carry into the exponent (7.9 becomes 4, not 8)."""
    e = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    spacing = ((tl.maximum(e - 127, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = spacing * 12582912.0  # 1.5 * 2**23
    return (v + magic) - magic


@triton.jit
def _w8a8_kernel(x_ptr, w_ptr, b_ptr, y_ptr, s_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_sn, BN_Q, BK_Q,
                 HAS_BIAS: tl.constexpr, BLOCKED: tl.constexpr, EVEN: tl.constexpr, SWAP: tl.constexpr,
                 EMULATE_CVT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    # Row tiles vary fastest: the programs of one weight tile run side by side and share it in L2.
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rg = tl.arange(0, GROUP)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    s_row = s_ptr + (pid_n * BLOCK_N // BN_Q) * stride_sn  # the program's rows lie in one scale block
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        for g in tl.static_range(BLOCK_K // GROUP):
            kk = k + g * GROUP + rg
            if EVEN:  # K is whole steps and N whole tiles: only x's padding rows are masked
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
                w = tl.load(w_rows + kk[None, :])
            else:
                k_ok = kk < K
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xf = x.to(tl.float32)
            xs = tl.math.div_rn(tl.maximum(tl.max(tl.abs(xf), 1), _AMAX_FLOOR), _FP8_MAX)
            v = tl.clamp(tl.math.div_rn(xf, xs[:, None]), -_FP8_MAX, _FP8_MAX)
            if EMULATE_CVT:
                v = _round_e4m3(v)
            xq = v.to(w_ptr.dtype.element_ty)
            if SWAP:  # the weight tile is the dot's A operand: Hopper's wgmma sees M = BLOCK_N
                part = tl.dot(w, tl.trans(xq)) * xs[None, :]
            else:
                part = tl.dot(xq, tl.trans(w)) * xs[:, None]
            if BLOCKED:
                part *= tl.load(s_row + (k + g * GROUP) // BK_Q)
            acc += part
    if SWAP:
        acc = tl.trans(acc)
    if not BLOCKED:
        acc *= tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _block_m(rows: int) -> int:
    """The rows' tile: tl.dot needs 16 at least; past 64 rows two or more row tiles."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def w8a8_config(n: int, k: int, rows: int) -> dict:
    """Tiles by the output width N, the depth K and the rows. All of them are guesses to be swept
    on the GPU (`python -m kernels.bench.fp8_gemv --sweep`), taken from the bf16 skinny GEMM's
    H200 sweep (kernels.gemv.skinny_config) with the K step in whole activation groups: narrow
    outputs (N <= 4096: o_proj, down_proj) 32 columns, so that ~120 programs cover the SMs, wider
    ones 64 (the smallest wgmma M under SWAP); the weight tile as the dot's A operand (SWAP);
    256-key steps (two groups); 4 warps; BLOCK_M the rows rounded up to 16 / 32 / 64; stages cut
    to what fits in ~200 KB of shared memory."""
    if n <= 4096:
        cfg = {"BLOCK_N": 32, "BLOCK_K": 256, "SWAP": True, "num_warps": 4, "num_stages": 6}
    else:
        cfg = {"BLOCK_N": 64, "BLOCK_K": 256, "SWAP": True, "num_warps": 4, "num_stages": 4}
    cfg["BLOCK_M"] = _block_m(rows)
    per_stage = (cfg["BLOCK_M"] * 2 + cfg["BLOCK_N"]) * cfg["BLOCK_K"]  # x in 16 bits, the weight in 8
    cfg["num_stages"] = max(1, min(cfg["num_stages"], (200 << 10) // per_stage))
    return cfg


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
           bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or not 1 <= x.shape[0] <= W8A8_MAX_ROWS:
        raise ValueError(f"w8a8_gemm takes 1 to {W8A8_MAX_ROWS} rows x [M, K], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"w8a8_gemm takes bfloat16 or float16 x, got {x.dtype}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, {x.shape[1]}], got {tuple(weight.shape)}")
    check_fp8_weight(weight, scale, block)
    if not w8a8_block_ok(block):
        raise ValueError(f"w8a8_gemm: scale blocks {block} must span whole {ACT_GROUP}-column activation groups "
                         f"and whole 16-row tiles")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")


def w8a8_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              block_size: tuple[int, int] | None = None, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """x[M, K] (bf16 / fp16, 1 <= M <= W8A8_MAX_ROWS) @ weight[N, K]^T (+ bias[N]) -> `out` or a
    new [M, N] tensor of x's dtype. `weight` float8_e4m3fn with fp32 `weight_scale`: [N] per row,
    or with `block_size` (bn, bk) [ceil(N/bn), ceil(K/bk)]. x is quantized per (row, 128
    columns) as `quantize_act_ref` says; the dot runs on e4m3 x e4m3 with fp32 sums. `config`:
    BLOCK_M, BLOCK_N, BLOCK_K (a multiple of ACT_GROUP), SWAP, num_warps, num_stages."""
    _check(x, weight, weight_scale, block_size, bias)
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a [{m}, {n}] {x.dtype} tensor with contiguous rows, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if n == 0:
        return out
    cfg = dict(config or w8a8_config(n, k, m))
    if block_size is not None and block_size[0] % cfg["BLOCK_N"]:
        if config is not None:
            raise ValueError(f"scale blocks {block_size} must be whole multiples of the tile's {cfg['BLOCK_N']} rows")
        cfg["BLOCK_N"] = 16 if block_size[0] % 32 else 32
    if cfg["BLOCK_K"] % ACT_GROUP or cfg["BLOCK_M"] not in (16, 32, 64, 128):
        raise ValueError(f"BLOCK_K must be a multiple of {ACT_GROUP} and BLOCK_M 16, 32, 64 or 128, got {cfg}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    blocked = block_size is not None
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _w8a8_kernel[grid](
        x, weight, bias if bias is not None else x, out, weight_scale, M=m, N=n, K=k, stride_xm=x.stride(0),
        stride_wn=weight.stride(0), stride_ym=out.stride(0), stride_sn=weight_scale.stride(0) if blocked else 0,
        BN_Q=block_size[0] if blocked else 1, BK_Q=block_size[1] if blocked else 1,
        HAS_BIAS=bias is not None, BLOCKED=blocked, EVEN=(n % cfg["BLOCK_N"] == 0 and k % cfg["BLOCK_K"] == 0),
        SWAP=cfg["SWAP"], EMULATE_CVT=os.environ.get("TRITON_INTERPRET") == "1", BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP=ACT_GROUP, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_args(x))
    return out
