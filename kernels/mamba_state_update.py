"""Mamba-2 decode step over the paged SSM state (mamba_ssm's `selective_state_update`, with
the engine's page indirection: read the state at init_page[s], write it to write_page[s]).

One token per sequence: x `[S, H, P]`, dt `[S, H]`, B/C `[S, G, N]`, A `[H]` (fp32, negative),
ssm_state `[num_pages, H, P, N]` (stride(0) arbitrary, each page contiguous), any state dtype.

    dt' = clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias, *dt_limit)
    h   = exp(dt' * A) * h_prev + dt' * (x outer B)            (fp32)
    y   = h . C + D * x ; out = y * silu(z) when z is given

y is taken from the fp32 h, before h is rounded to the state dtype (as mamba_ssm and vLLM; the
transformers torch path rounds h to C's dtype first). dt_limit is applied as in the chunked scan
(mamba_ssm's decode kernel has no limit; with the default (0, inf) after softplus both agree).

Bandwidth-bound: each program owns BLOCK_P rows of one head's state [P, N] (~2K elements, so a
batch-1 step still has H * P / BLOCK_P programs), reads them once and writes them once. A
program reads and writes only its own rows, and each written element depends on the element read
at the same address, so an in-place update (write page == init page) has no race.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import pdl_args, pdl_wait

__all__ = ["selective_state_update", "selective_state_update_ref"]


@triton.jit
def _state_update_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dtb_ptr, z_ptr, out_ptr,
                         state_ptr, init_ptr, write_ptr,
                         P, N, heads_per_group, dt_lo, dt_hi,
                         sx_s, sx_h, sdt_s, sb_s, sb_g, sc_s, sc_g, sz_s, sz_h, so_s, so_h,
                         st_page, st_h, st_p,
                         HAS_D: tl.constexpr, HAS_DTB: tl.constexpr, HAS_Z: tl.constexpr, SOFTPLUS: tl.constexpr,
                         BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    pm = p < P
    nm = n < N
    m2 = pm[:, None] & nm[None, :]
    g = h // heads_per_group
    src = tl.load(init_ptr + s).to(tl.int64)
    dst = tl.load(write_ptr + s).to(tl.int64)
    st_off = h * st_h + p[:, None] * st_p + n[None, :]
    ok = m2 & (tl.zeros(m2.shape, tl.int64) + src > 0)  # (the interpreter rejects mask & scalar)
    state = tl.load(state_ptr + src * st_page + st_off, mask=ok, other=0.0).to(tl.float32)

    dt = tl.load(dt_ptr + s * sdt_s + h).to(tl.float32)
    if HAS_DTB:
        dt += tl.load(dtb_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))), dt)
    dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
    dA = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + s * sx_s + h * sx_h + p, mask=pm, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + s * sb_s + g * sb_g + n, mask=nm, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + s * sc_s + g * sc_g + n, mask=nm, other=0.0).to(tl.float32)
    state = state * dA + (x * dt)[:, None] * Bv[None, :]
    if dst > 0:
        tl.store(state_ptr + dst * st_page + st_off, state.to(state_ptr.dtype.element_ty), mask=m2)
    y = tl.sum(state * Cv[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(D_ptr + h).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + s * sz_s + h * sz_h + p, mask=pm, other=0.0).to(tl.float32)
        y = y * z / (1.0 + tl.exp(-z))
    tl.store(out_ptr + s * so_s + h * so_h + p, y.to(out_ptr.dtype.element_ty), mask=pm)


def check_ssm_operands(x, dt, A, B, C, D, dt_bias, ssm_state) -> tuple[int, int, int, int, int]:
    """(tokens, heads, head dim, groups, state size) of the operands the decode step and the scan
    share; their shapes checked."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    assert dt.shape == (T, H) and A.shape == (H,), (dt.shape, A.shape)
    assert B.shape == (T, G, N) and C.shape == (T, G, N) and H % G == 0, (B.shape, C.shape, H)
    assert D is None or D.shape == (H,)
    assert dt_bias is None or dt_bias.shape == (H,)
    assert ssm_state.dim() == 4 and ssm_state.shape[1:] == (H, P, N), (ssm_state.shape, H, P, N)
    return T, H, P, G, N


def _check(x, dt, A, B, C, D, dt_bias, ssm_state, init_page, write_page, z) -> tuple[int, int, int, int, int]:
    S, H, P, G, N = check_ssm_operands(x, dt, A, B, C, D, dt_bias, ssm_state)
    assert z is None or z.shape == (S, H, P)
    assert init_page.shape == (S,) and write_page.shape == (S,)
    return S, H, P, G, N


def selective_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                           D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                           dt_limit: tuple[float, float], ssm_state: torch.Tensor, init_page: torch.Tensor,
                           write_page: torch.Tensor, z: torch.Tensor | None = None,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step for S sequences; returns out `[S, H, P]` in x's dtype. Inputs may be
    strided views with a unit last stride (their strides are passed, nothing is copied)."""
    S, H, P, G, N = _check(x, dt, A, B, C, D, dt_bias, ssm_state, init_page, write_page, z)
    for t in (x, dt, B, C) + ((z,) if z is not None else ()):
        assert t.stride(-1) == 1, "inputs need a unit last stride"
    assert ssm_state.stride(3) == 1, ssm_state.stride()
    if out is None:
        out = torch.empty((S, H, P), dtype=x.dtype, device=x.device)
    assert out.shape == (S, H, P) and out.stride(-1) == 1
    if S == 0:
        return out
    block_n = triton.next_power_of_2(N)
    block_p = min(triton.next_power_of_2(P), max(1, 2048 // block_n))
    zz = z if z is not None else x
    _state_update_kernel[(S, H, triton.cdiv(P, block_p))](
        x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, zz, out,
        ssm_state, init_page, write_page,
        P, N, H // G, float(dt_limit[0]), float(dt_limit[1]),
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        zz.stride(0), zz.stride(1), out.stride(0), out.stride(1),
        ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        HAS_D=D is not None, HAS_DTB=dt_bias is not None, HAS_Z=z is not None, SOFTPLUS=bool(dt_softplus),
        BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4 if block_p * block_n >= 1024 else 2,
        **pdl_args(x))
    return out


def selective_state_update_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                               D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                               dt_limit: tuple[float, float], ssm_state: torch.Tensor, init_page: torch.Tensor,
                               write_page: torch.Tensor, z: torch.Tensor | None = None,
                               out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `selective_state_update` (fp32; fp64 for fp64 inputs)."""
    from kernels.mamba_conv import _gather_pages
    S, H, P, G, _N = _check(x, dt, A, B, C, D, dt_bias, ssm_state, init_page, write_page, z)
    acc = torch.promote_types(x.dtype, torch.float32)
    h0 = _gather_pages(ssm_state, init_page, acc)  # [S, H, P, N]
    dtv = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit, acc)  # [S, H]
    rep = H // G
    Bh = B.to(acc).repeat_interleave(rep, dim=1)  # [S, H, N]
    Ch = C.to(acc).repeat_interleave(rep, dim=1)
    xf = x.to(acc)
    h = h0 * torch.exp(dtv * A.to(acc))[..., None, None] + (xf * dtv[..., None])[..., None] * Bh[:, :, None, :]
    page = write_page.long()
    keep = page > 0
    ssm_state[page[keep]] = h[keep].to(ssm_state.dtype)
    y = torch.einsum("shpn,shn->shp", h, Ch)
    if D is not None:
        y = y + xf * D.to(acc)[:, None]
    if z is not None:
        y = y * F.silu(z.to(acc))
    if out is None:
        out = torch.empty((S, H, P), dtype=x.dtype, device=x.device)
    out.copy_(y)
    return out


def _discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool,
                   dt_limit: tuple[float, float], acc: torch.dtype) -> torch.Tensor:
    """dt' = clamp(softplus(dt + dt_bias) or dt + dt_bias, lo, hi) in `acc` (the clamp after the
    softplus, as transformers' mamba2_chunk_scan)."""
    d = dt.to(acc)
    if dt_bias is not None:
        d = d + dt_bias.to(acc)
    if dt_softplus:
        d = F.softplus(d)
    return d.clamp(min=float(dt_limit[0]), max=float(dt_limit[1]))
