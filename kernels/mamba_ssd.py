"""Mamba-2 SSD chunked scan over a ragged batch (prefill, chunked prefill), with the paged SSM
state: the initial state of each sequence is read from its page and the state after every chunk
with a page is written (checkpoints for the prefix cache, the final state for decode).

Math, per head h (group g = h // (H // G)), state [P, N]:
    dt'_t = clamp(softplus(dt_t + dt_bias) if dt_softplus else dt_t + dt_bias, lo, hi)
    h_t   = exp(dt'_t A) h_{t-1} + dt'_t x_t B_t^T ;   y_t = h_t C_t + D x_t

Chunked (SSD) form, chunk of L tokens with a_t = dt'_t A and cum_i = a_0 + ... + a_i:
    y_i    = sum_{j<=i} (C_i . B_j) exp(cum_i - cum_j) dt'_j x_j   (quadratic, intra-chunk)
           + exp(cum_i) (h_prev C_i)                              (state entering the chunk)
           + D x_i
    h_next = exp(cum_L) h_prev + sum_j exp(cum_L - cum_j) dt'_j x_j B_j^T

Triton design: one program per (sequence, head, block of BLOCK_P rows of P) walks that
sequence's chunks in order, keeping the state [BLOCK_P, N] in fp32 registers; per chunk four
`tl.dot`s (C B^T, the masked decay matrix times x, C h^T, x^T B). Why not the mamba_ssm
multi-kernel split (chunk states, state passing, chunk scan): its intermediate states
[chunks, H, P, N] in fp32 are 64 MB per 4096 tokens at Bamba-9B's shape (chunk 256) and must be
written and read back; here the state never leaves registers, initial states are read and
checkpoints written by the program that owns them (so an init page that is also a write page has
no race: each written element depends on the read of the same element by the same program), and
host-chosen chunk boundaries (checkpoints at arbitrary tokens, sequences of 1 token) cost
nothing special. Parallelism is S x H x P/BLOCK_P programs: at batch 1 with H = 128 heads and
BLOCK_P = 64 that is one wave of an H100 (132 SMs); BLOCK_P halves when the grid would fill less
than half of the SMs (`default_config`). Per token the work is 2 P N (state in and out, the same
as the recurrence, but on tensor cores) + L (N + P) (the quadratic part), L the chunk length.

The compute chunk is the host's chunk (1..SSD_MAX_CHUNK tokens, masked in a SSD_MAX_CHUNK tile).
SSD_MAX_CHUNK = 64: 128 would add 64 (N + P) multiply-adds per token (+43% at N = 128, P = 64)
and does not fit in registers; 32 would halve the quadratic part but double the sequential steps and
put every product on mma.sync (wgmma needs 64 rows). Not yet timed on a GPU (no device time was
left when this was written): `python -m kernels.bench.mamba --sweep` times BLOCK_P / warps.

Numerics (as mamba_ssm): dot operands in the activation dtype (16-bit inputs: the decay-weighted
C B^T, the state entering C h^T and the scaled x are rounded to it), fp32 accumulation, fp32
state carried between chunks, `ieee` fp32 products for fp32 inputs. The decay exp(cum_i - cum_j)
is a difference of fp32 prefix sums (fine unless one token's |dt A| is huge while later ones are
tiny); the reference uses exact segment sums.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.mamba_conv import _gather_pages
from kernels.mamba_state_update import _discretize_dt, check_ssm_operands

__all__ = ["SSD_MAX_CHUNK", "ChunkRound", "chunk_rounds", "default_config", "ssd_scan_varlen", "ssd_scan_varlen_ref"]

SSD_MAX_CHUNK = 64


@triton.jit
def _dot_operand(v, DOT_DTYPE: tl.constexpr, DOT_F32: tl.constexpr):
    """Round to the dot dtype (what the GPU multiplies); under the interpreter, bf16 products
    run in fp32 (see kernels/paged_attention.py::_interpreter_bf16), from the rounded values."""
    v = v.to(DOT_DTYPE)
    if DOT_F32:
        v = v.to(tl.float32)
    return v


@triton.jit
def _first_ge(ptr, n, value):
    """First i in [0, n] with ptr[i] >= value (ptr sorted ascending, n + 1 entries)."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(ptr + mid) < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


# The batch shape changes every step: no specialisation on these values (== 1, divisible by 16).
@triton.jit(do_not_specialize=["num_chunks"])
def _ssd_varlen_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dtb_ptr, out_ptr, state_ptr,
    qsl_ptr, init_ptr, cstart_ptr, cpage_ptr,
    num_chunks, P, N, heads_per_group, dt_lo, dt_hi,
    sx_t, sx_h, sdt_t, sb_t, sb_g, sc_t, sc_g, so_t, so_h, st_page, st_h, st_p,
    HAS_D: tl.constexpr, HAS_DTB: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr, PRECISION: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    seq_start = tl.load(qsl_ptr + s)
    seq_end = tl.load(qsl_ptr + s + 1)
    if seq_start >= seq_end:
        return
    g = h // heads_per_group
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    l = tl.arange(0, BLOCK_L)
    pm = p < P
    nm = n < N
    st_off = p[:, None] * st_p + n[None, :]  # inside the head's [P, N] block of a page
    st_mask = pm[:, None] & nm[None, :]

    page = tl.load(init_ptr + s).to(tl.int64)
    ok = st_mask & (tl.zeros(st_mask.shape, tl.int64) + page > 0)  # (the interpreter rejects mask & scalar)
    state = tl.load(state_ptr + page * st_page + h * st_h + st_off, mask=ok, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + h).to(tl.float32)
    if HAS_DTB:
        dt_b = tl.load(dtb_ptr + h).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + h).to(tl.float32)
    causal = l[:, None] >= l[None, :]

    c_begin = _first_ge(cstart_ptr, num_chunks, seq_start)
    c_end = _first_ge(cstart_ptr, num_chunks, seq_end)
    for c in range(c_begin, c_end):
        t0 = tl.load(cstart_ptr + c)
        t1 = tl.load(cstart_ptr + c + 1)
        lm = l < t1 - t0
        # scalar 64-bit bases of the chunk + 32-bit offsets inside it (fewer registers than
        # 64-bit per-element pointer arithmetic)
        t0l = t0.to(tl.int64)
        x_c = x_ptr + t0l * sx_t + h * sx_h
        o_c = out_ptr + t0l * so_t + h * so_h
        b_c = B_ptr + t0l * sb_t + g * sb_g
        c_c = C_ptr + t0l * sc_t + g * sc_g

        dt = tl.load(dt_ptr + t0l * sdt_t + h + l * sdt_t, mask=lm, other=0.0).to(tl.float32)
        if HAS_DTB:
            dt += dt_b
        if SOFTPLUS:
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))), dt)
        dt = tl.minimum(tl.maximum(dt, dt_lo), dt_hi)
        dt = tl.where(lm, dt, 0.0)  # padding rows: no decay, no input
        a = dt * A
        cum = tl.cumsum(a, axis=0)
        last = tl.sum(a, axis=0)

        x = tl.load(x_c + l[:, None] * sx_t + p[None, :], mask=lm[:, None] & pm[None, :], other=0.0)
        Bm = tl.load(b_c + l[:, None] * sb_t + n[None, :], mask=lm[:, None] & nm[None, :], other=0.0)
        Cm = tl.load(c_c + l[:, None] * sc_t + n[None, :], mask=lm[:, None] & nm[None, :], other=0.0)
        xd = _dot_operand(x, x_ptr.dtype.element_ty, DOT_F32)
        Bd = _dot_operand(Bm, x_ptr.dtype.element_ty, DOT_F32)
        Cd = _dot_operand(Cm, x_ptr.dtype.element_ty, DOT_F32)

        # intra-chunk: (C B^T) o exp(segsum) o dt_j, times x
        cb = tl.dot(Cd, tl.trans(Bd), input_precision=PRECISION)  # [L, L]
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        m = cb * decay * dt[None, :]
        # the state entering the chunk, decayed to each position
        h_in = _dot_operand(state, x_ptr.dtype.element_ty, DOT_F32)
        y_off = tl.dot(Cd, tl.trans(h_in), input_precision=PRECISION)
        y = tl.dot(_dot_operand(m, x_ptr.dtype.element_ty, DOT_F32), xd, y_off * tl.exp(cum)[:, None],
                   input_precision=PRECISION)  # [L, BLOCK_P]
        if HAS_D:
            y += D * x.to(tl.float32)
        tl.store(o_c + l[:, None] * so_t + p[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=lm[:, None] & pm[None, :])

        # state after the chunk
        w = tl.exp(last - cum) * dt  # [L]; 0 on padding rows
        xs = _dot_operand(x.to(tl.float32) * w[:, None], x_ptr.dtype.element_ty, DOT_F32)
        state = tl.dot(tl.trans(xs), Bd, state * tl.exp(last), input_precision=PRECISION)  # [BLOCK_P, BLOCK_N]
        wpage = tl.load(cpage_ptr + c).to(tl.int64)
        if wpage > 0:
            tl.store(state_ptr + wpage * st_page + h * st_h + st_off, state.to(state_ptr.dtype.element_ty),
                     mask=st_mask)


def _check(x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc, init_page, chunk_start, chunk_seq, chunk_page):
    T, H, P, G, N = check_ssm_operands(x, dt, A, B, C, D, dt_bias, ssm_state)
    S = init_page.shape[0]
    assert query_start_loc.shape == (S + 1,), (query_start_loc.shape, S)
    NC = chunk_seq.shape[0]
    assert chunk_start.shape == (NC + 1,) and chunk_page.shape == (NC,)
    return T, H, P, G, N, S, NC


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def default_config(P: int, N: int, num_seqs_x_heads: int, device: torch.device) -> dict:
    """BLOCK_P and launch options. A program holds its state [BLOCK_P, N] (fp32), the chunk's
    B and C [64, N], C B^T [64, 64] and the outputs [64, BLOCK_P]: at N = 128 that is 255
    registers per thread with 8 warps (one program per SM) and some spilling (ptxas for sm_90:
    ~1.2 KB of stack at BLOCK_P = 64, ~0.9 KB at 32; 4 warps spill twice as much). Not yet timed on
    a GPU: `python -m kernels.bench.mamba --sweep` times the alternatives; pass `config=` to
    override. BLOCK_P halves (C B^T is then computed once per half) while the grid would fill
    less than half of the GPU's SMs."""
    bp = min(64, max(16, triton.next_power_of_2(P)))
    if device.type == "cuda":
        sms = _num_sms(device)
        while bp > 16 and 2 * num_seqs_x_heads * triton.cdiv(P, bp) <= sms:
            bp //= 2
    bn = max(16, triton.next_power_of_2(N))
    return {"BLOCK_P": bp, "num_warps": 8 if bp * bn >= 4096 else 4, "num_stages": 2}


def ssd_scan_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                    D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                    dt_limit: tuple[float, float], ssm_state: torch.Tensor, query_start_loc: torch.Tensor,
                    init_page: torch.Tensor, chunk_start: torch.Tensor, chunk_seq: torch.Tensor,
                    chunk_page: torch.Tensor, out: torch.Tensor | None = None,
                    config: dict | None = None) -> torch.Tensor:
    """x `[T, H, P]`, dt `[T, H]`, A `[H]` (fp32), B/C `[T, G, N]`, D/dt_bias `[H]` or None;
    the state `ssm_state[num_pages, H, P, N]` is read at init_page[s] and written after every
    chunk with chunk_page > 0. Inputs may be strided views with a unit last stride (x: the heads
    of one token at a constant stride). Returns out `[T, H, P]` in x's dtype."""
    T, H, P, G, N, S, NC = _check(x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc, init_page,
                                  chunk_start, chunk_seq, chunk_page)
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), x.dtype
    assert B.dtype == x.dtype and C.dtype == x.dtype, (x.dtype, B.dtype, C.dtype)
    for t in (x, dt, B, C):
        assert t.stride(-1) == 1, "inputs need a unit last stride"
    assert ssm_state.stride(3) == 1, ssm_state.stride()
    if out is None:
        out = torch.empty((T, H, P), dtype=x.dtype, device=x.device)
    assert out.shape == (T, H, P) and out.stride(-1) == 1
    if S == 0 or NC == 0:
        return out
    block_n = max(16, triton.next_power_of_2(N))
    cfg = config or default_config(P, N, S * H, x.device)
    block_p = cfg["BLOCK_P"]
    interp_bf16 = os.environ.get("TRITON_INTERPRET") == "1" and x.dtype == torch.bfloat16
    _ssd_varlen_kernel[(S, H, triton.cdiv(P, block_p))](
        x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, out, ssm_state,
        query_start_loc, init_page, chunk_start, chunk_page,
        NC, P, N, H // G, float(dt_limit[0]), float(dt_limit[1]),
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        out.stride(0), out.stride(1), ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        HAS_D=D is not None, HAS_DTB=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
        BLOCK_L=SSD_MAX_CHUNK, BLOCK_P=block_p, BLOCK_N=block_n, DOT_F32=interp_bf16,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L] with [i, j] = a[j+1] + ... + a[i] for j <= i, -inf above the
    diagonal (sums of the segment, not differences of prefix sums: transformers' segment_sum)."""
    L = a.shape[-1]
    x = a[..., :, None].expand(*a.shape, L)  # [..., k, j] = a[k]
    x = x.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), -1), 0)
    seg = torch.cumsum(x, dim=-2)
    return seg.masked_fill(~torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), 0), float("-inf"))


@dataclass
class ChunkRound:
    """The r-th host chunk of every sequence that has one (m chunks), for the torch references."""
    seq: torch.Tensor    # [m] their sequences
    L: int               # the longest of them
    valid: torch.Tensor  # [m, L] the rows that are tokens
    tok: torch.Tensor    # [m, L] the token of each row (padding rows clamped to a valid index)
    pages: torch.Tensor  # [m] the page each chunk's final state is written to (<= 0: none)


def chunk_rounds(query_start_loc: torch.Tensor, chunk_start: torch.Tensor, chunk_seq: torch.Tensor,
                 chunk_page: torch.Tensor, T: int):
    """The host chunks in rounds, round r the r-th chunk of every sequence: a reference computes
    a round at once, vectorised over its chunks, and carries each sequence's state to the next."""
    dev = chunk_start.device
    cs = chunk_start.long()
    starts, lens = cs[:-1], cs[1:] - cs[:-1]
    cseq = chunk_seq.long()
    first = torch.searchsorted(starts, query_start_loc.long()[:-1])  # first chunk of each sequence
    rank = torch.arange(cseq.shape[0], device=dev) - first[cseq]
    pages = chunk_page.long()
    for r in range(int(rank.max()) + 1):
        idx = (rank == r).nonzero().squeeze(1)
        L = int(lens[idx].max())
        pos = torch.arange(L, device=dev)
        yield ChunkRound(cseq[idx], L, pos[None, :] < lens[idx][:, None],
                         (starts[idx][:, None] + pos[None, :]).clamp_max(T - 1), pages[idx])


def ssd_scan_varlen_ref(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                        D: torch.Tensor | None, dt_bias: torch.Tensor | None, dt_softplus: bool,
                        dt_limit: tuple[float, float], ssm_state: torch.Tensor, query_start_loc: torch.Tensor,
                        init_page: torch.Tensor, chunk_start: torch.Tensor, chunk_seq: torch.Tensor,
                        chunk_page: torch.Tensor, out: torch.Tensor | None = None,
                        config: dict | None = None) -> torch.Tensor:
    """Same contract as `ssd_scan_varlen` (`config` is ignored), on the given chunks (fp32; fp64 for fp64 inputs, the
    exact oracle of the tests). The k-th chunks of all sequences are processed together (a loop
    over the longest sequence's chunk count), each in the quadratic form, vectorised over the
    chunk's tokens, the heads and the sequences."""
    T, H, P, G, _N, S, NC = _check(x, dt, A, B, C, D, dt_bias, ssm_state, query_start_loc, init_page,
                                  chunk_start, chunk_seq, chunk_page)
    acc = torch.promote_types(x.dtype, torch.float32)
    dev = x.device
    if out is None:
        out = torch.empty((T, H, P), dtype=x.dtype, device=dev)
    if S == 0 or NC == 0:
        return out
    state = _gather_pages(ssm_state, init_page, acc)  # [S, H, P, N]; all read before any write
    dtv = _discretize_dt(dt, dt_bias, dt_softplus, dt_limit, acc)  # [T, H]
    Af = A.to(acc)
    head_group = torch.arange(H, device=dev) // (H // G)
    Dh = D.to(acc) if D is not None else None

    for rnd in chunk_rounds(query_start_loc, chunk_start, chunk_seq, chunk_page, T):
        seq, L, valid, tok = rnd.seq, rnd.L, rnd.valid, rnd.tok
        d_ = dtv[tok] * valid[..., None]  # [m, L, H], 0 on padding
        a = d_ * Af
        xc = x[tok].to(acc) * valid[..., None, None]  # [m, L, H, P]
        Bc = B[tok].to(acc)[:, :, head_group]  # [m, L, H, N]
        Cc = C[tok].to(acc)[:, :, head_group]
        seg = _segsum(a.transpose(1, 2))  # [m, H, L, L]
        decay = torch.exp(seg)
        # intra-chunk
        cb = torch.einsum("mihn,mjhn->mhij", Cc, Bc)
        y = torch.einsum("mhij,mjh,mjhp->mihp", cb * decay, d_, xc)
        # state entering the chunk
        h_prev = state[seq]  # [m, H, P, N]
        y = y + torch.einsum("mihn,mhpn->mihp", Cc, h_prev) * torch.exp(torch.cumsum(a, 1))[..., None]
        if Dh is not None:
            y = y + xc * Dh[:, None]
        out[tok[valid]] = y[valid].to(out.dtype)
        # state after the chunk: decay from token j to the chunk's end = the last row of the segsum
        to_end = decay[:, :, L - 1, :].transpose(1, 2) * d_  # [m, L, H]
        h_new = h_prev * torch.exp(a.sum(1))[..., None, None] + torch.einsum("mjh,mjhp,mjhn->mhpn", to_end, xc, Bc)
        state[seq] = h_new
        keep = rnd.pages > 0
        if keep.any():
            ssm_state[rnd.pages[keep]] = h_new[keep].to(ssm_state.dtype)
    return out
