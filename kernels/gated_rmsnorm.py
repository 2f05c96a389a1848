"""Gated grouped RMSNorm of the Mamba-2 mixers (Bamba, Falcon-H1, NemotronH...): the scan output
`x` is gated by `silu(z)` and RMS-normalised per group of `group_size` channels.

- `norm_before_gate=False` (Bamba, Mamba-2): g = x * silu(z); out = g * rsqrt(mean_group(g^2) + eps) * w
- `norm_before_gate=True` (Falcon-H1's default): out = x * rsqrt(mean_group(x^2) + eps) * w * silu(z)

Numerics: everything in fp32 (x, z and w are upcast), output in x's dtype. Where the result is
rounded to x's dtype differs between the transformers classes, so it is an option:
- `round_before_weight=False` (default): one rounding at the very end, as FalconH1RMSNormGated,
  vLLM's RMSNormGated and mamba_ssm's fused kernel do.
- `round_before_weight=True`: BambaRMSNormGated's order: the normalised value is rounded to x's
  dtype first (`hidden_states.to(input_dtype)`), then multiplied by the weight (`self.weight *
  ...`, a product in the weight's dtype, i.e. computed in fp32 and rounded once more). Only
  meaningful with norm_before_gate=False (Bamba has no other form).
With either choice the gate product x * silu(z) is formed in fp32 from the unrounded x (both
classes upcast x before it: Bamba casts x first, Falcon multiplies x by an fp32 silu(z)).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import pdl_args, pdl_wait

__all__ = ["gated_rms_norm", "gated_rms_norm_ref", "GatedRMSNorm", "gated_norm_values"]


@dataclass(frozen=True)
class GatedRMSNorm:
    """The gated RMSNorm a product's input goes through first (`gemv(..., norm=)`): the gate `z`
    `[1, I]`, the weight `[I]` and the options of `gated_rms_norm`."""
    z: torch.Tensor
    weight: torch.Tensor
    group_size: int
    eps: float
    norm_before_gate: bool = False
    round_before_weight: bool = False

    def apply(self, x: torch.Tensor, ref: bool = False) -> torch.Tensor:
        fn = gated_rms_norm_ref if ref else gated_rms_norm
        return fn(x, self.z, self.weight, self.group_size, self.eps, self.norm_before_gate, self.round_before_weight)


@triton.jit
def gated_norm_values(x, z, w, group_size, eps, NORM_BEFORE_GATE: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
                      DTYPE: tl.constexpr):
    """fp32 tiles [groups, BLOCK] (masked entries 0) -> the normalised, gated values in DTYPE:
    the one formula of the norm kernel and of the GEMV that takes the norm as its prologue."""
    gate = z / (1.0 + tl.exp(-z))
    if not NORM_BEFORE_GATE:
        x = x * gate
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / group_size + eps)
    y = x * rstd[:, None]
    if ROUND_BEFORE_WEIGHT:
        y = y.to(DTYPE).to(tl.float32)
    y = y * w
    if NORM_BEFORE_GATE:
        y = y * gate
    return y.to(DTYPE)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, num_groups, group_size, eps, sx, sz, so,
                           NORM_BEFORE_GATE: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr,
                           GROUPS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = tl.arange(0, BLOCK)
    mask = (groups < num_groups)[:, None] & (cols < group_size)[None, :]
    offs = groups[:, None] * group_size + cols[None, :]
    x = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + row * sz + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = gated_norm_values(x, z, w, group_size, eps, NORM_BEFORE_GATE, ROUND_BEFORE_WEIGHT, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * so + offs, y, mask=mask)


def _check(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int) -> None:
    assert x.dim() == 2 and z.shape == x.shape, (x.shape, z.shape)
    assert weight.shape == (x.shape[1],), (weight.shape, x.shape)
    assert group_size > 0 and x.shape[1] % group_size == 0, (x.shape, group_size)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                   norm_before_gate: bool = False, round_before_weight: bool = False,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x, z `[T, I]` (row strides arbitrary, unit column stride), weight `[I]`; returns `out`
    `[T, I]` in x's dtype (unit column stride; x itself allowed), a new contiguous tensor if None.
    One program per row and GROUPS groups, GROUPS such that a program holds about 2,048 channels:
    one program per narrow group (128 channels, the Gated DeltaNet's value heads) left a thread per
    element and ran a prefill's norm at a seventh of the copy bandwidth on an H200."""
    _check(x, z, weight, group_size)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if z.stride(-1) != 1:
        z = z.contiguous()
    T, I = x.shape
    if out is None:
        out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    assert out.shape == (T, I) and out.dtype == x.dtype and out.stride(-1) == 1, (out.shape, out.dtype)
    if T == 0:
        return out
    block = triton.next_power_of_2(group_size)
    assert block <= 65536, "group too wide for one program"
    num_groups = I // group_size
    groups = min(triton.next_power_of_2(num_groups), max(1, 2048 // block))
    tile = groups * block
    _gated_rms_norm_kernel[(T, triton.cdiv(num_groups, groups))](
        x, z, weight, out, num_groups, group_size, float(eps), x.stride(0), z.stride(0), out.stride(0),
        NORM_BEFORE_GATE=bool(norm_before_gate), ROUND_BEFORE_WEIGHT=bool(round_before_weight), GROUPS=groups,
        BLOCK=block, num_warps=4 if tile <= 2048 else 8 if tile <= 8192 else 16, **pdl_args(x))
    return out


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float,
                       norm_before_gate: bool = False, round_before_weight: bool = False) -> torch.Tensor:
    """Same contract as `gated_rms_norm`; fp32 math (fp64 for fp64 inputs)."""
    _check(x, z, weight, group_size)
    acc = torch.promote_types(x.dtype, torch.float32)
    T, I = x.shape
    xf, gate = x.to(acc), F.silu(z.to(acc))
    if not norm_before_gate:
        xf = xf * gate
    g = xf.view(T, I // group_size, group_size)
    y = (g * torch.rsqrt(g.square().mean(-1, keepdim=True) + eps)).view(T, I)
    if round_before_weight:
        y = y.to(x.dtype).to(acc)
    y = y * weight.to(acc)
    if norm_before_gate:
        y = y * gate
    return y.to(x.dtype)
