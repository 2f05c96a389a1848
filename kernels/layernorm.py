"""RMSNorm, optionally fused with the residual add (vLLM's `rms_norm` / `fused_add_rms_norm`), and
optionally preceded by a first RMSNorm of x (`pre_weight`: Gemma's post-attention or
post-feed-forward norm, then the add, then the next norm: two launches in one).

Why a Triton kernel: RMSNorm is memory-bound. Eager torch makes ~6 passes over the row (upcast,
square, mean, rsqrt-multiply, weight-multiply, downcast) and the residual add two more; the
kernel reads x (and residual) once and writes out (and new_residual) once, keeping the row in
registers. So it wins for both forms (H200, T=4096, hidden 4096/5376, bf16, vs `rms_norm_ref`:
21-29 us vs 250-317 us plain, 45-49 us vs 430-545 us with the add, ~3 TB/s; `kernels.bench.layer_ops`).

Numerics (both implementations): the residual sum is rounded to x's dtype, stored as
new_residual, and the norm is computed in fp32 from that rounded value, as vLLM's CUDA kernel
does, so `out == rms_norm(new_residual)` exactly in form. The first norm's output is rounded to
x's dtype before the add, as when it runs as a kernel of its own. Gemma's form scales by
(1 + weight).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_args, pdl_wait

__all__ = ["rms_norm", "rms_norm_ref"]


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, pre_w_ptr, out_ptr, new_res_ptr, n_cols, eps,
                     sx, sr, so, snr,
                     HAS_RES: tl.constexpr, HAS_PRE: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr,
                     DENSE_NEXT: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # The weights before the PDL wait: no kernel writes them (kernels/pdl.py), and at a decode
    # step they come from HBM, the longest load of the launch.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    if HAS_PRE:
        pw = tl.load(pre_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if GEMMA:
            pw = pw + 1.0
    # Before a dense projection (`rms_norm`'s `feeds_dense_projection`) the residual stream is
    # read here as well, from HBM while the kernel before ends (the norm of the sublayer before
    # wrote it, launches back), and the projection launches as this program exits.
    if HAS_RES and DENSE_NEXT:
        r = tl.load(res_ptr + row * sr + cols, mask=mask, other=0.0)
    if DENSE_NEXT:
        pdl_wait(PDL, LAUNCH_NEXT=False)
    else:
        pdl_wait(PDL)
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
    if HAS_PRE:
        xf = x.to(tl.float32)
        x = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps) * pw).to(out_ptr.dtype.element_ty)
    if HAS_RES:
        if not DENSE_NEXT:
            r = tl.load(res_ptr + row * sr + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * snr + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    tl.store(out_ptr + row * so + cols, (xf * rstd * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [rows, H] with a unit last stride (the kernel indexes columns directly)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             gemma: bool = False, pre_weight: torch.Tensor | None = None, feeds_dense_projection: bool = False,
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Returns new tensors (`out`, and `new_residual = x + residual` when residual is given, x
    first normed by `pre_weight` when given); the inputs are not modified. Whole row per
    program: fine up to hidden ~16K.

    `feeds_dense_projection` (a dense decoder's norms: Gemma 2 and 3) changes the launch, not the
    result. With PDL (kernels/pdl.py) the residual is then read before the wait for the kernel
    launched just before, so it must not be that kernel's output (a residual stream comes from an
    earlier norm's `new_residual`, the embedding, or a torch op, which lets the next kernel launch
    only when done), and the next kernel launches as this one exits (`pdl_wait`'s
    `LAUNCH_NEXT`). H200, Gemma-3-12B at batch 1, its 97 norms a step: FP8 weights 4.22-4.23 ->
    4.13-4.16 ms a step, bf16 6.41 -> 6.38 (one call). On Qwen3.6-35B-A3B and gpt-oss-120b, whose
    norms also feed routers, the same launch made the step 0.5-1% slower, so theirs keep the
    default."""
    hidden = x.shape[-1]
    assert weight.shape == (hidden,), (weight.shape, x.shape)
    assert pre_weight is None or pre_weight.shape == (hidden,), (pre_weight.shape, x.shape)
    assert residual is None or residual.shape == x.shape, (residual.shape, x.shape)
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_res = torch.empty_like(out) if residual is not None else out
    r2 = _rows(residual) if residual is not None else x2
    o2, nr2 = out.view(-1, hidden), new_res.view(-1, hidden)
    block = triton.next_power_of_2(hidden)
    assert block <= 65536, "row too wide for one program"
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, pre_weight if pre_weight is not None else weight, o2, nr2, hidden, float(eps),
            x2.stride(0), r2.stride(0), o2.stride(0), nr2.stride(0),
            HAS_RES=residual is not None, HAS_PRE=pre_weight is not None, GEMMA=gemma, BLOCK=block,
            DENSE_NEXT=feeds_dense_projection,
            num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16, **pdl_args(x2))
    return (out, new_res) if residual is not None else out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                 gemma: bool = False, pre_weight: torch.Tensor | None = None, feeds_dense_projection: bool = False,
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rms_norm` (`feeds_dense_projection` changes only a kernel's launch).
    Computes in fp32 (fp64 for fp64 inputs, so tests can use it as the exact oracle)."""
    if pre_weight is not None:
        x = rms_norm_ref(x, pre_weight, eps, gemma=gemma)
    acc = torch.promote_types(x.dtype, torch.float32)
    new_res = None
    if residual is not None:
        new_res = (x.to(acc) + residual.to(acc)).to(x.dtype)
        x = new_res
    xf = x.to(acc)
    w = weight.to(acc)
    if gemma:
        w = w + 1.0
    out = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * w).to(x.dtype)
    return (out, new_res) if residual is not None else out
