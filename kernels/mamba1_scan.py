"""Mamba-1 selective scan over the paged SSM state (Jamba's Mamba layers): the prefill scan over a
ragged batch (`selective_scan_varlen`) and the decode step (`selective_scan_update`), each with a
torch reference of the same signature.

Mamba-1 differs from Mamba-2 (`mamba_ssd.py`) in that A is per (channel, state) and dt per
channel: no scalar decay per head, so no SSD matrix form. Per channel d, state h [N]:

    dt'_t = softplus(dt_t + dt_bias)                                  (fp32)
    h_t   = exp(dt'_t A[d]) h_{t-1} + dt'_t x_t B_t                   (fp32)
    y_t   = h_t . C_t + D x_t ;  out_t = y_t * silu(z_t) when z is given

x, dt, z `[T, Dm]`, B/C `[T, N]` (one group: every channel reads the same B and C), A `[Dm, N]`
fp32, D and dt_bias `[Dm]`; ssm_state `[num_pages, Dm, N]` (stride(0) arbitrary, each page
contiguous), any dtype. Pages and chunks as the Mamba-2 kernels (kernels/README.md, "Mamba
kernels"): a page <= 0 is "none" (read as zeros, never written); the prefill reads each
sequence's state at init_page[s] and writes the state after every chunk with chunk_page > 0 (the
final state, and the checkpoints the prefix cache keeps); the decode step reads init_page[s] and
writes write_page[s] (which may be the same page).

Triton: one program per (sequence, block of BLOCK_D channels) keeps the state [BLOCK_D, N] in fp32
registers and walks the sequence's tokens in order (the recurrence is elementwise per channel: no
matrix product to put on tensor cores), loading each token's inputs one token ahead. Each program reads and writes only its own channels'
state, each written element depending on the element read at the same address, so an init page
that is also a write page has no race. A prefill's parallelism is S x Dm / BLOCK_D programs
(Jamba-Mini at TP=1: Dm = 8192, 128 to 512 programs a sequence); BLOCK_D shrinks while the grid
would fill less than twice the SMs. Not yet timed on a GPU.

Numerics: fp32 math and state between tokens; y is taken from the fp32 state before it is
rounded to the state dtype (mamba_ssm, vLLM); softplus with torch's threshold (20).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.mamba_conv import _gather_pages
from kernels.mamba_ssd import _first_ge, _num_sms
from kernels.pdl import pdl_args, pdl_wait

__all__ = ["selective_scan_update", "selective_scan_update_ref", "selective_scan_varlen",
           "selective_scan_varlen_ref"]


@triton.jit
def _load_token(x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, t, d, n, dm, nm, sx, sdt, sb, sc, sz, HAS_Z: tl.constexpr):
    """Token t's inputs for one program's channels (fp32): x, dt (raw), B, C, z (zeros without)."""
    x = tl.load(x_ptr + t * sx + d, mask=dm, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + t * sdt + d, mask=dm, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + t * sb + n, mask=nm, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + t * sc + n, mask=nm, other=0.0).to(tl.float32)
    z = tl.zeros(x.shape, tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + t * sz + d, mask=dm, other=0.0).to(tl.float32)
    return x, dt, Bv, Cv, z


@triton.jit
def _step(state, A, Dv, dtb, x, dt, Bv, Cv, z, HAS_D: tl.constexpr, HAS_DTB: tl.constexpr, HAS_Z: tl.constexpr):
    """One token: (the new state, the output)."""
    if HAS_DTB:
        dt += dtb
    dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))), dt)
    state = state * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * Bv[None, :]
    y = tl.sum(state * Cv[None, :], axis=1)
    if HAS_D:
        y += Dv * x
    if HAS_Z:
        y = y * z / (1.0 + tl.exp(-z))
    return state, y


# The batch shape changes every step: no specialisation on these values (== 1, divisible by 16).
@triton.jit(do_not_specialize=["num_chunks"])
def _scan_varlen_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dtb_ptr, z_ptr, out_ptr, state_ptr,
                        qsl_ptr, init_ptr, cstart_ptr, cpage_ptr,
                        num_chunks, Dm, N, sx, sdt, sb, sc, sz, so, st_page, st_d,
                        HAS_D: tl.constexpr, HAS_DTB: tl.constexpr, HAS_Z: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    s = tl.program_id(0)
    seq_start = tl.load(qsl_ptr + s)
    seq_end = tl.load(qsl_ptr + s + 1)
    if seq_start >= seq_end:
        return
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    dm = d < Dm
    nm = n < N
    m2 = dm[:, None] & nm[None, :]
    st_off = d[:, None] * st_d + n[None, :]
    page = tl.load(init_ptr + s).to(tl.int64)
    ok = m2 & (tl.zeros(m2.shape, tl.int64) + page > 0)  # (the interpreter rejects mask & scalar)
    state = tl.load(state_ptr + page * st_page + st_off, mask=ok, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + d[:, None] * N + n[None, :], mask=m2, other=0.0).to(tl.float32)
    Dv = tl.zeros([BLOCK_D], tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=dm, other=0.0).to(tl.float32)
    dtb = tl.zeros([BLOCK_D], tl.float32)
    if HAS_DTB:
        dtb = tl.load(dtb_ptr + d, mask=dm, other=0.0).to(tl.float32)
    # One loop over the sequence's tokens, the next token's inputs loaded before this one's state
    # update (which waits on them otherwise: a dependent chain of one load latency a token); the
    # state is written at the end of every chunk that has a page.
    c = _first_ge(cstart_ptr, num_chunks, seq_start)
    chunk_end = tl.load(cstart_ptr + c + 1)
    start = seq_start.to(tl.int64)
    x, dt, Bv, Cv, z = _load_token(x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, start, d, n, dm, nm, sx, sdt, sb, sc, sz, HAS_Z)
    for i in range(0, seq_end - seq_start):
        t = start + i
        more = tl.zeros([BLOCK_D], tl.int64) + t + 1 < seq_end  # (the interpreter rejects mask & scalar)
        x1, dt1, B1, C1, z1 = _load_token(x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, t + 1, d, n, dm & more,
                                          nm & (tl.zeros([BLOCK_N], tl.int64) + t + 1 < seq_end),
                                          sx, sdt, sb, sc, sz, HAS_Z)
        state, y = _step(state, A, Dv, dtb, x, dt, Bv, Cv, z, HAS_D, HAS_DTB, HAS_Z)
        tl.store(out_ptr + t * so + d, y.to(out_ptr.dtype.element_ty), mask=dm)
        if t + 1 == chunk_end:
            wpage = tl.load(cpage_ptr + c).to(tl.int64)
            if wpage > 0:
                tl.store(state_ptr + wpage * st_page + st_off, state.to(state_ptr.dtype.element_ty), mask=m2)
            c += 1
            chunk_end = tl.load(cstart_ptr + c + 1, mask=c < num_chunks, other=0)
        x, dt, Bv, Cv, z = x1, dt1, B1, C1, z1


@triton.jit
def _scan_update_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dtb_ptr, z_ptr, out_ptr, state_ptr,
                        init_ptr, write_ptr, Dm, N, sx, sdt, sb, sc, sz, so, st_page, st_d,
                        HAS_D: tl.constexpr, HAS_DTB: tl.constexpr, HAS_Z: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    dm = d < Dm
    nm = n < N
    m2 = dm[:, None] & nm[None, :]
    st_off = d[:, None] * st_d + n[None, :]
    src = tl.load(init_ptr + s).to(tl.int64)
    dst = tl.load(write_ptr + s).to(tl.int64)
    ok = m2 & (tl.zeros(m2.shape, tl.int64) + src > 0)  # (the interpreter rejects mask & scalar)
    state = tl.load(state_ptr + src * st_page + st_off, mask=ok, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + d[:, None] * N + n[None, :], mask=m2, other=0.0).to(tl.float32)
    Dv = tl.zeros([BLOCK_D], tl.float32)
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=dm, other=0.0).to(tl.float32)
    dtb = tl.zeros([BLOCK_D], tl.float32)
    if HAS_DTB:
        dtb = tl.load(dtb_ptr + d, mask=dm, other=0.0).to(tl.float32)
    x, dt, Bv, Cv, z = _load_token(x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, s, d, n, dm, nm, sx, sdt, sb, sc, sz, HAS_Z)
    state, y = _step(state, A, Dv, dtb, x, dt, Bv, Cv, z, HAS_D, HAS_DTB, HAS_Z)
    tl.store(out_ptr + s * so + d, y.to(out_ptr.dtype.element_ty), mask=dm)
    if dst > 0:
        tl.store(state_ptr + dst * st_page + st_off, state.to(state_ptr.dtype.element_ty), mask=m2)


# ----------------------------------------------------------------------------- host side

def _check(x, dt, A, B, C, D, dt_bias, z, ssm_state) -> tuple[int, int, int]:
    """(tokens, channels, state size), the shapes checked."""
    assert x.dim() == 2, x.shape
    T, Dm = x.shape
    N = A.shape[1]
    assert dt.shape == (T, Dm) and A.shape == (Dm, N) and A.is_contiguous(), (dt.shape, A.shape)
    assert B.shape == (T, N) and C.shape == (T, N), (B.shape, C.shape)
    assert D is None or D.shape == (Dm,)
    assert dt_bias is None or dt_bias.shape == (Dm,)
    assert z is None or z.shape == (T, Dm)
    assert ssm_state.dim() == 3 and ssm_state.shape[1:] == (Dm, N), (ssm_state.shape, Dm, N)
    return T, Dm, N


def _check_strides(out, ssm_state, *tensors) -> None:
    for t in tensors:
        if t is not None:
            assert t.stride(-1) == 1, "inputs need a unit last stride"
    assert ssm_state.stride(2) == 1, ssm_state.stride()
    assert out.stride(-1) == 1


def _block_d(Dm: int, N: int, programs_per_block: int, device: torch.device, cap: int) -> int:
    """BLOCK_D: `cap` channels at most (a [BLOCK_D, N] fp32 state in registers), halved (down to
    16) while the grid would fill less than twice the GPU's SMs."""
    bd = min(cap, triton.next_power_of_2(Dm))
    if device.type == "cuda":
        sms = _num_sms(device)
        while bd > 16 and programs_per_block * triton.cdiv(Dm, bd) < 2 * sms:
            bd //= 2
    return bd


def selective_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_state: torch.Tensor,
                          query_start_loc: torch.Tensor, init_page: torch.Tensor, chunk_start: torch.Tensor,
                          chunk_seq: torch.Tensor, chunk_page: torch.Tensor, z: torch.Tensor | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill: returns out `[T, Dm]` in x's dtype; the state after every chunk with a page is
    written there. Inputs may be strided views with a unit last stride."""
    T, Dm, N = _check(x, dt, A, B, C, D, dt_bias, z, ssm_state)
    S, NC = init_page.shape[0], chunk_seq.shape[0]
    assert query_start_loc.shape == (S + 1,) and chunk_start.shape == (NC + 1,) and chunk_page.shape == (NC,)
    if out is None:
        out = torch.empty((T, Dm), dtype=x.dtype, device=x.device)
    assert out.shape == (T, Dm)
    _check_strides(out, ssm_state, x, dt, B, C, z)
    if S == 0 or NC == 0:
        return out
    block_n = triton.next_power_of_2(N)
    block_d = _block_d(Dm, N, S, x.device, max(16, 2048 // block_n))
    zz = z if z is not None else x
    _scan_varlen_kernel[(S, triton.cdiv(Dm, block_d))](
        x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, zz, out, ssm_state,
        query_start_loc, init_page, chunk_start, chunk_page,
        NC, Dm, N, x.stride(0), dt.stride(0), B.stride(0), C.stride(0), zz.stride(0), out.stride(0),
        ssm_state.stride(0), ssm_state.stride(1),
        HAS_D=D is not None, HAS_DTB=dt_bias is not None, HAS_Z=z is not None,
        BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4 if block_d * block_n >= 1024 else 2)
    return out


def selective_scan_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_state: torch.Tensor,
                          init_page: torch.Tensor, write_page: torch.Tensor, z: torch.Tensor | None = None,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode, one token per sequence (x `[S, Dm]`): reads the state at init_page[s], writes the
    new one to write_page[s]; returns out `[S, Dm]`. No host synchronisation (CUDA graphs)."""
    S, Dm, N = _check(x, dt, A, B, C, D, dt_bias, z, ssm_state)
    assert init_page.shape == (S,) and write_page.shape == (S,)
    if out is None:
        out = torch.empty((S, Dm), dtype=x.dtype, device=x.device)
    assert out.shape == (S, Dm)
    _check_strides(out, ssm_state, x, dt, B, C, z)
    if S == 0:
        return out
    block_n = triton.next_power_of_2(N)
    block_d = _block_d(Dm, N, S, x.device, max(16, 1024 // block_n))
    zz = z if z is not None else x
    _scan_update_kernel[(S, triton.cdiv(Dm, block_d))](
        x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, zz, out, ssm_state,
        init_page, write_page, Dm, N, x.stride(0), dt.stride(0), B.stride(0), C.stride(0), zz.stride(0),
        out.stride(0), ssm_state.stride(0), ssm_state.stride(1),
        HAS_D=D is not None, HAS_DTB=dt_bias is not None, HAS_Z=z is not None,
        BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4 if block_d * block_n >= 1024 else 2, **pdl_args(x))
    return out


# ----------------------------------------------------------------------------- references

def _discretize(dt: torch.Tensor, dt_bias: torch.Tensor | None, acc: torch.dtype) -> torch.Tensor:
    d = dt.to(acc)
    if dt_bias is not None:
        d = d + dt_bias.to(acc)
    return F.softplus(d)


def _outputs(h: torch.Tensor, x: torch.Tensor, C: torch.Tensor, D: torch.Tensor | None,
             z: torch.Tensor | None) -> torch.Tensor:
    """y = h . C + D x, times silu(z): h [m, Dm, N], x/z [m, Dm], C [m, N] (all in acc)."""
    y = torch.einsum("mdn,mn->md", h, C)
    if D is not None:
        y = y + x * D
    return y * F.silu(z) if z is not None else y


def selective_scan_varlen_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                              D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_state: torch.Tensor,
                              query_start_loc: torch.Tensor, init_page: torch.Tensor, chunk_start: torch.Tensor,
                              chunk_seq: torch.Tensor, chunk_page: torch.Tensor, z: torch.Tensor | None = None,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `selective_scan_varlen` (fp32; fp64 for fp64 inputs): the recurrence one
    position at a time, vectorised over the sequences and channels."""
    T, Dm, N = _check(x, dt, A, B, C, D, dt_bias, z, ssm_state)
    S = init_page.shape[0]
    acc = torch.promote_types(x.dtype, torch.float32)
    dev = x.device
    if out is None:
        out = torch.empty((T, Dm), dtype=x.dtype, device=dev)
    if S == 0 or T == 0:
        return out
    state = _gather_pages(ssm_state, init_page, acc)  # [S, Dm, N]; all read before any write
    dtv = _discretize(dt, dt_bias, acc)  # [T, Dm]
    Af, Dh = A.to(acc), (D.to(acc) if D is not None else None)
    # the page the state after token t goes to (a chunk's last token), 0 for none
    end_page = torch.zeros(T, dtype=torch.long, device=dev)
    end_page[chunk_start[1:].long() - 1] = chunk_page.long()
    qsl = query_start_loc.long()
    starts, lens = qsl[:-1], qsl[1:] - qsl[:-1]
    for i in range(int(lens.max())):
        seqs = (lens > i).nonzero().squeeze(1)
        tok = starts[seqs] + i
        d_ = dtv[tok]  # [m, Dm]
        xs = x[tok].to(acc)
        h = state[seqs] * torch.exp(d_[..., None] * Af) + (d_ * xs)[..., None] * B[tok].to(acc)[:, None, :]
        state[seqs] = h
        out[tok] = _outputs(h, xs, C[tok].to(acc), Dh, z[tok].to(acc) if z is not None else None).to(out.dtype)
        pages = end_page[tok]
        keep = pages > 0
        if keep.any():
            ssm_state[pages[keep]] = h[keep].to(ssm_state.dtype)
    return out


def selective_scan_update_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                              D: torch.Tensor | None, dt_bias: torch.Tensor | None, ssm_state: torch.Tensor,
                              init_page: torch.Tensor, write_page: torch.Tensor, z: torch.Tensor | None = None,
                              out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `selective_scan_update` (fp32; fp64 for fp64 inputs)."""
    S, Dm, N = _check(x, dt, A, B, C, D, dt_bias, z, ssm_state)
    assert init_page.shape == (S,) and write_page.shape == (S,)
    acc = torch.promote_types(x.dtype, torch.float32)
    h0 = _gather_pages(ssm_state, init_page, acc)  # [S, Dm, N]
    d_ = _discretize(dt, dt_bias, acc)
    xs = x.to(acc)
    h = h0 * torch.exp(d_[..., None] * A.to(acc)) + (d_ * xs)[..., None] * B.to(acc)[:, None, :]
    page = write_page.long()
    keep = page > 0
    ssm_state[page[keep]] = h[keep].to(ssm_state.dtype)
    y = _outputs(h, xs, C.to(acc), D.to(acc) if D is not None else None, z.to(acc) if z is not None else None)
    if out is None:
        out = torch.empty((S, Dm), dtype=x.dtype, device=x.device)
    out.copy_(y)
    return out
