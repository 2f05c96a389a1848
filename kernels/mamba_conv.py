"""Depthwise causal conv1d of the Mamba-2 mixers over the paged conv state (prefill/varlen and
decode), with `silu` or no activation.

Layouts (kernels/README.md, "Mamba kernels"): `conv_state[num_pages, K-1, D]`, row 0 the oldest
input, row K-2 the newest; `stride(0)` arbitrary (a layer's view of the page pool), unit last
stride. A page index <= 0 is "none": read as zeros, never written.

out[t, d] = act(bias[d] + sum_j weight[d, j] * xin[t - (K-1) + j, d]), where inputs before a
sequence's first token come from its initial conv state. fp32 math, one rounding to out's dtype
(as the causal_conv1d CUDA kernel; transformers' torch path rounds the conv to the weight dtype
before the activation, a one-ulp difference).

Varlen kernel: one program per (block of BLOCK_T tokens, block of BLOCK_D channels) of the
flattened batch (tokens are independent given their K-1 predecessors, so a prefill of thousands
of tokens is fully parallel), plus one program per (chunk, channel block) writing the conv state
after the chunk. All initial states are first gathered into a small scratch tensor
`[S, K-1, D]` (zeros for page <= 0) by a separate launch, and the main launch reads initial
inputs only from there: a sequence's init page may be one of its write pages, and a write can
never overtake a read that way (launches are ordered).
Decode kernel: one program per (sequence, channel block) reads the K-1 state rows, then writes
the shifted rows to the write page (possibly the same page; a barrier separates the reads from
the writes of the program, and no other program touches that page region).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.pdl import pdl_args, pdl_wait

__all__ = ["ConvStep", "conv_step", "causal_conv1d_update", "causal_conv1d_update_ref", "causal_conv1d_varlen",
           "causal_conv1d_varlen_ref"]


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _gather_conv_state_kernel(state_ptr, page_ptr, scratch_ptr, D, s_page, s_row, sc_seq,
                              KM1: tl.constexpr, BLOCK_D: tl.constexpr):
    """scratch[s] = conv_state[init_page[s]] (zeros when the page is <= 0)."""
    s = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    page = tl.load(page_ptr + s).to(tl.int64)
    for r in tl.static_range(KM1):
        # (a scalar condition is broadcast explicitly: Triton's interpreter rejects `mask & scalar`)
        ok = dm & (tl.zeros(dm.shape, tl.int64) + page > 0)
        v = tl.load(state_ptr + page * s_page + r * s_row + d, mask=ok, other=0.0)
        tl.store(scratch_ptr + s * sc_seq + r * D + d, v, mask=dm)


@triton.jit
def _find_seq_vec(qsl_ptr, t, num_seqs, n_iter):
    """For each token t (a vector), the last s in [0, num_seqs) with qsl[s] <= t (vectorised
    binary search; empty sequences are skipped since a later s with the same start wins)."""
    lo = tl.zeros_like(t)
    hi = tl.zeros_like(t) + num_seqs
    for _ in range(n_iter):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(qsl_ptr + mid, mask=active, other=0)
        go_right = active & (v <= t)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(active & ~go_right, mid, hi)
    return lo - 1


# Batch sizes change every step: no specialisation on their values (== 1, divisible by 16).
@triton.jit(do_not_specialize=["T", "num_seqs", "num_chunks", "n_tblocks", "n_iter"])
def _conv_varlen_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, scratch_ptr, state_ptr,
                        qsl_ptr, cstart_ptr, cseq_ptr, cpage_ptr,
                        T, D, num_seqs, num_chunks, n_tblocks, n_iter,
                        sx, so, sw, s_page, s_row, sc_seq,
                        K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    if pid < n_tblocks:
        # ---- outputs of BLOCK_T tokens
        t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
        tm = t < T
        seq = _find_seq_vec(qsl_ptr, t, num_seqs, n_iter)
        seq = tl.where(tm, seq, 0)
        start = tl.load(qsl_ptr + seq, mask=tm, other=0)
        acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + d, mask=dm, other=0.0).to(tl.float32)[None, :]
        for j in tl.static_range(K):
            p = t - (K - 1) + j  # input position of tap j
            xv = tl.load(x_ptr + p.to(tl.int64)[:, None] * sx + d[None, :],
                         mask=(tm & (p >= start))[:, None] & dm[None, :], other=0.0).to(tl.float32)
            wj = tl.load(w_ptr + d * sw + j, mask=dm, other=0.0).to(tl.float32)
            acc += xv * wj[None, :]
        # taps before a sequence's first token read its initial state: only in blocks holding
        # one of the first K-1 tokens of a sequence (a separate pass keeps the common path lean)
        if tl.min(tl.where(tm, t - start, K), axis=0) < K - 1:
            for j in tl.static_range(K - 1):
                p = t - (K - 1) + j
                r = (K - 1) + p - start  # row of the initial state
                sv = tl.load(scratch_ptr + seq.to(tl.int64)[:, None] * sc_seq + r[:, None] * D + d[None, :],
                             mask=(tm & (p < start))[:, None] & dm[None, :], other=0.0).to(tl.float32)
                wj = tl.load(w_ptr + d * sw + j, mask=dm, other=0.0).to(tl.float32)
                acc += sv * wj[None, :]
        if SILU:
            acc = _silu(acc)
        tl.store(out_ptr + t.to(tl.int64)[:, None] * so + d[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tm[:, None] & dm[None, :])
    else:
        # ---- conv state after chunk c: its last K-1 inputs
        c = pid - n_tblocks
        page = tl.load(cpage_ptr + c).to(tl.int64)
        if page > 0:
            end = tl.load(cstart_ptr + c + 1)
            s = tl.load(cseq_ptr + c)
            start = tl.load(qsl_ptr + s)
            r = tl.arange(0, BLOCK_R)
            p = end - (K - 1) + r  # input positions of the state rows
            rm = (r < K - 1)[:, None] & dm[None, :]
            in_x = (p >= start)[:, None]
            xv = tl.load(x_ptr + p.to(tl.int64)[:, None] * sx + d[None, :], mask=rm & in_x, other=0.0)
            sv = tl.load(scratch_ptr + s.to(tl.int64) * sc_seq + ((K - 1) + p - start)[:, None] * D + d[None, :],
                         mask=rm & ~in_x, other=0.0)
            v = tl.where(in_x, xv.to(tl.float32), sv.to(tl.float32))
            tl.store(state_ptr + page * s_page + r[:, None] * s_row + d[None, :],
                     v.to(state_ptr.dtype.element_ty), mask=rm)


@triton.jit
def conv_step(xv, d, dm, w_ptr, bias_ptr, state_ptr, src, dst, sw, s_page, s_row, K: tl.constexpr,
              HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_R: tl.constexpr):
    """One token's conv over channels d (mask dm; xv their inputs as stored): the K-1 rows of page
    src (zeros when src <= 0) and xv through the taps, fp32 out; the shifted rows and xv written
    to page dst (skipped when dst <= 0; it may be src). The one formula of the decode kernel and
    of the GEMV that takes the conv as its epilogue (`ConvStep`)."""
    r = tl.arange(0, BLOCK_R)
    rm = r < K - 1
    # the K-1 old state rows, all loaded before anything is stored
    m2 = rm[:, None] & dm[None, :]
    ok = m2 & (tl.zeros(m2.shape, tl.int64) + src > 0)  # (explicit broadcast: the interpreter rejects mask & scalar)
    rows = tl.load(state_ptr + src * s_page + r[:, None] * s_row + d[None, :], mask=ok, other=0.0)
    w = tl.load(w_ptr + d[None, :] * sw + r[:, None], mask=m2, other=0.0).to(tl.float32)
    acc = tl.sum(rows.to(tl.float32) * w, axis=0)
    acc += xv.to(tl.float32) * tl.load(w_ptr + d * sw + (K - 1), mask=dm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=dm, other=0.0).to(tl.float32)
    if SILU:
        acc = _silu(acc)
    if dst > 0:
        tl.debug_barrier()  # every read of the page precedes the writes (dst may be src)
        # old row r (r >= 1) becomes row r - 1; x becomes row K-2
        tl.store(state_ptr + dst * s_page + (r[:, None] - 1) * s_row + d[None, :], rows,
                 mask=m2 & (r[:, None] >= 1))
        tl.store(state_ptr + dst * s_page + (K - 2) * s_row + d, xv.to(state_ptr.dtype.element_ty), mask=dm)
    return acc


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, state_ptr, init_ptr, write_ptr,
                        D, sx, so, sw, s_page, s_row,
                        K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    s = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dm = d < D
    src = tl.load(init_ptr + s).to(tl.int64)
    dst = tl.load(write_ptr + s).to(tl.int64)
    xv = tl.load(x_ptr + s * sx + d, mask=dm, other=0.0)
    acc = conv_step(xv, d, dm, w_ptr, bias_ptr, state_ptr, src, dst, sw, s_page, s_row, K, HAS_BIAS, SILU, BLOCK_R)
    tl.store(out_ptr + s * so + d, acc.to(out_ptr.dtype.element_ty), mask=dm)


@dataclass(frozen=True)
class ConvStep:
    """One decode step of the causal conv over columns [start, start + D) of a product's output,
    in place (`linear_op(..., conv=)`; the one-row GEMV applies it in its epilogue, saving the
    conv's launch): weight [D, K], bias [D] or None, the conv state [pages, K-1, D] and each
    row's init and write page, as `causal_conv1d_update` takes them."""
    weight: torch.Tensor
    bias: torch.Tensor | None
    state: torch.Tensor
    init_page: torch.Tensor
    write_page: torch.Tensor
    start: int = 0
    activation: str | None = "silu"

    @property
    def channels(self) -> int:
        return self.weight.shape[0]

    def check(self, y_shape: tuple[int, int]) -> None:
        """Refuses a conv that does not fit a product of shape `y_shape` [rows, N]."""
        rows, n = y_shape
        if not 0 <= self.start <= n - self.channels:
            raise ValueError(f"conv columns [{self.start}, {self.start + self.channels}) lie outside the product's "
                             f"{n} columns")
        if tuple(self.init_page.shape) != (rows,) or tuple(self.write_page.shape) != (rows,):
            raise ValueError(f"the conv needs an init and a write page per row ({rows}), got "
                             f"{tuple(self.init_page.shape)} and {tuple(self.write_page.shape)}")

    def apply(self, y: torch.Tensor, ref: bool = False) -> torch.Tensor:
        """y's conv columns through the step, in place (the kernel, or its reference); returns y."""
        self.check(tuple(y.shape))
        x = y[:, self.start:self.start + self.channels]
        fn = causal_conv1d_update_ref if ref else causal_conv1d_update
        fn(x, self.weight, self.bias, self.state, self.init_page, self.write_page, self.activation, out=x)
        return y


def _check_common(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                  activation: str | None) -> tuple[int, int]:
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    D = x.shape[1]
    assert weight.dim() == 2 and weight.shape[0] == D and weight.stride(-1) == 1, weight.shape
    K = weight.shape[1]
    assert K >= 2, "conv width must be >= 2"
    assert bias is None or bias.shape == (D,), bias.shape
    assert conv_state.dim() == 3 and conv_state.shape[1:] == (K - 1, D), (conv_state.shape, K, D)
    assert conv_state.stride(2) == 1, conv_state.stride()
    assert activation in (None, "silu", "swish"), activation
    return D, K


def _block_d(D: int) -> int:
    return min(triton.next_power_of_2(D), 256)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                         query_start_loc: torch.Tensor, init_page: torch.Tensor, chunk_start: torch.Tensor,
                         chunk_seq: torch.Tensor, chunk_page: torch.Tensor, activation: str | None = "silu",
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill/varlen: x `[T, D]` (row stride arbitrary), weight `[D, K]`, bias `[D]` or None;
    query_start_loc `[S+1]`, init_page `[S]`, chunk_start `[NC+1]`, chunk_seq/chunk_page `[NC]`
    (int32). Writes the conv state after every chunk with chunk_page > 0. Returns out `[T, D]`."""
    D, K = _check_common(x, weight, bias, conv_state, activation)
    T = x.shape[0]
    S = init_page.shape[0]
    NC = chunk_seq.shape[0]
    if out is None:
        out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    assert out.shape == (T, D) and out.stride(-1) == 1
    if S == 0 or (T == 0 and NC == 0):
        return out
    block_d = _block_d(D)
    scratch = torch.empty((S, K - 1, D), dtype=conv_state.dtype, device=x.device)
    _gather_conv_state_kernel[(S, triton.cdiv(D, block_d))](
        conv_state, init_page, scratch, D, conv_state.stride(0), conv_state.stride(1), scratch.stride(0),
        KM1=K - 1, BLOCK_D=block_d, num_warps=4)
    # 16 x 128 tiles, 4 warps: 80 registers for sm_90 and no spills (32 x 128 needs 211)
    block_t = 16
    block_d2 = min(triton.next_power_of_2(D), 128)
    n_tblocks = triton.cdiv(T, block_t)
    _conv_varlen_kernel[(n_tblocks + NC, triton.cdiv(D, block_d2))](
        x, weight, bias if bias is not None else weight, out, scratch, conv_state,
        query_start_loc, chunk_start, chunk_seq, chunk_page,
        T, D, S, NC, n_tblocks, S.bit_length(),
        x.stride(0), out.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1), scratch.stride(0),
        K=K, HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_R=triton.next_power_of_2(K - 1),
        BLOCK_T=block_t, BLOCK_D=block_d2, num_warps=4)
    return out


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
                         init_page: torch.Tensor, write_page: torch.Tensor, activation: str | None = "silu",
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode, one token per sequence: x `[S, D]`; reads the state at init_page[s] (zeros if
    <= 0), writes the shifted state to write_page[s] (skipped if <= 0; may equal init_page)."""
    D, K = _check_common(x, weight, bias, conv_state, activation)
    S = x.shape[0]
    assert init_page.shape == (S,) and write_page.shape == (S,)
    if out is None:
        out = torch.empty((S, D), dtype=x.dtype, device=x.device)
    assert out.shape == (S, D) and out.stride(-1) == 1
    if S == 0:
        return out
    block_d = _block_d(D)
    _conv_update_kernel[(S, triton.cdiv(D, block_d))](
        x, weight, bias if bias is not None else weight, out, conv_state, init_page, write_page,
        D, x.stride(0), out.stride(0), weight.stride(0), conv_state.stride(0), conv_state.stride(1),
        K=K, HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_R=triton.next_power_of_2(K - 1),
        BLOCK_D=block_d, num_warps=4, **pdl_args(x))
    return out


# ----------------------------------------------------------------------------- references

def _gather_pages(state: torch.Tensor, pages: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """state[pages] in `acc`, zeros where the page is <= 0 (page 0 is never read)."""
    pages = pages.long()
    got = state[pages.clamp_min(0)].to(acc)
    return torch.where((pages > 0).view(-1, *([1] * (state.dim() - 1))), got, torch.zeros((), dtype=acc,
                                                                                           device=got.device))


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if activation is not None else y


def causal_conv1d_varlen_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_state: torch.Tensor, query_start_loc: torch.Tensor, init_page: torch.Tensor,
                             chunk_start: torch.Tensor, chunk_seq: torch.Tensor, chunk_page: torch.Tensor,
                             activation: str | None = "silu", out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `causal_conv1d_varlen`, as a few gathers (fp32; fp64 for fp64 inputs).
    Inputs are indexed in a pool [x rows; initial state rows of every sequence]."""
    D, K = _check_common(x, weight, bias, conv_state, activation)
    T, S = x.shape[0], init_page.shape[0]
    acc = torch.promote_types(x.dtype, torch.float32)
    dev = x.device
    init = _gather_pages(conv_state, init_page, acc)  # [S, K-1, D], read before any write
    pool = torch.cat([x.to(acc), init.reshape(S * (K - 1), D)])
    qsl = query_start_loc.long()

    def rows(pos: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        """Pool rows of input positions `pos` of sequences `seq` (same shape)."""
        start = qsl[seq]
        return torch.where(pos >= start, pos, T + seq * (K - 1) + (K - 1) + pos - start)

    taps = torch.arange(K, device=dev) - (K - 1)
    if out is None:
        out = torch.empty((T, D), dtype=x.dtype, device=dev)
    if T > 0:
        t = torch.arange(T, device=dev)
        seq = torch.searchsorted(qsl[1:], t, right=True)
        idx = rows(t[:, None] + taps[None, :], seq[:, None].expand(T, K))  # [T, K]
        y = torch.einsum("tkd,dk->td", pool[idx], weight.to(acc))
        if bias is not None:
            y = y + bias.to(acc)
        out.copy_(_act(y, activation))
    page = chunk_page.long()
    keep = page > 0
    if keep.any():
        end = chunk_start[1:].long()[keep]
        cs = chunk_seq.long()[keep]
        idx = rows(end[:, None] + taps[None, 1:] - 1, cs[:, None].expand(-1, K - 1))  # last K-1 inputs
        conv_state[page[keep]] = pool[idx].to(conv_state.dtype)
    return out


def causal_conv1d_update_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_state: torch.Tensor, init_page: torch.Tensor, write_page: torch.Tensor,
                             activation: str | None = "silu", out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `causal_conv1d_update` (fp32; fp64 for fp64 inputs)."""
    _D, _K = _check_common(x, weight, bias, conv_state, activation)
    acc = torch.promote_types(x.dtype, torch.float32)
    win = torch.cat([_gather_pages(conv_state, init_page, acc), x.to(acc)[:, None]], 1)  # [S, K, D]
    y = torch.einsum("skd,dk->sd", win, weight.to(acc))
    if bias is not None:
        y = y + bias.to(acc)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out.copy_(_act(y, activation))
    page = write_page.long()
    keep = page > 0
    conv_state[page[keep]] = win[keep, 1:].to(conv_state.dtype)
    return out
