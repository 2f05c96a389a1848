"""Gated DeltaNet (the linear-attention layers of Qwen3-Next / Qwen3.5) over the paged recurrent
state: a chunked prefill over a ragged batch (`gated_delta_varlen`, checkpoints written after the
chunks that carry a page) and the decode step in place in the pool (`gated_delta_update`).

Math, per value head h (key head h // (Hv // Hk)), state S [K, V] (fp32), per token t:
    beta_t = sigmoid(b_t)                      (rounded to b's dtype, as transformers)
    g_t    = -exp(A_log) * softplus(a_t + dt_bias)            (fp32)
    q_t, k_t L2-normalised in fp32 (x * rsqrt(sum(x^2) + 1e-6)), q_t scaled by K^-0.5
    S   = exp(g_t) S ;  delta = beta_t (v_t - k_t S) ;  S = S + k_t^T delta ;  o_t = q_t S

Chunked form (transformers' torch_chunk_gated_delta_rule), chunk of L tokens, G_i = g_0 + ... + g_i:
    A   = strictly-lower(beta_i k_i.k_j exp(G_i - G_j))        T = (I + A)^-1 (unit lower)
    v_new = T (beta v) - T (beta k exp(G)) S  =  T (beta (v - exp(G) (k S)))
    o   = exp(G) (q S) + (q k^T exp(G_i - G_j), lower incl. the diagonal) v_new
    S'  = exp(G_L) S + (k exp(G_L - G))^T v_new
Every exponent is <= 0 (g <= 0), so nothing overflows however strong the decay. The kernel uses
the right-hand form of v_new: T is applied to one [L, BLOCK_V] right-hand side instead of
forming w = T (beta k exp(G)) [L, K] (L^2 K more multiply-adds per program).

Prefill, fused form: one program per (sequence, value head, block of BLOCK_V state columns) walks
that sequence's host chunks in order with its [K, BLOCK_V] state in fp32 registers, as
kernels/mamba_ssd.py (why one fused kernel rather than FLA's six: no per-chunk states, w, u or
v_new in global memory; checkpoints written by the program that owns the columns, so an init page
that is also a write page has no race; host-chosen chunk ends cost nothing special). Per chunk:
the products k k^T, q k^T, k S, q S, P v_new, k^T v_new are `tl.dot`s on [64, .] tiles; A, the
solve and q k^T do not depend on the state columns and are recomputed by each of the V/BLOCK_V
programs of a head (the price of the fusion: at K = V = 128, the two programs of BLOCK_V = 64
of a head issue ~17% more products than one program of the whole head would, four of 32 ~50%).

The triangular solve (x = T rhs, L = 64) is blocked in 16-row blocks, all on tensor cores:
1. the four 16x16 diagonal blocks D_ii of A, as a [4, 16, 16] tensor, are inverted by recursive
   doubling: (I + D)^-1 of a 2w block is [[X1, 0], [-X2 D21 X1, X2]] from the inverses of its two
   w blocks, w = 1, 2, 4, 8; batched 16x16 `tl.dot`s. This is the recursive triangular inverse,
   as stable as forward substitution (every product is a block of the true inverse), unlike the
   Neumann product (I - D)(I + D^2)(I + D^4)(I + D^8), whose powers grow like binomial
   coefficients when keys are correlated and then cancel;
2. with Dinv = blockdiag((I + D_ii)^-1), E = the strictly block-lower part of A, N = Dinv E and
   c = Dinv rhs, the system (I + A) x = rhs is x = c - N x: iterated from x = c it is block
   forward substitution (N is nilpotent, block i is exact after i steps), so ceil(len/16) - 1
   [64, 64] x [64, BLOCK_V] products. Row-by-row forward substitution would be 63 sequential
   steps of cross-warp reductions per chunk; forming T by doubling up to 64 costs ~10 [64]^3
   products.
FLA solves the same system in separate kernels (16x16 forward substitution, then merging the
inverses with products): the same blocking, here kept in registers.

Prefill, split form (a few long sequences: the fused walk of one sequence is a chain of ~128
chunk steps, each with a solve), FLA's layout in three launches:
1. `_gdn_chunk_prep_kernel`, a program per (chunk, value head), all in parallel, forms T (the
   blocked solve above against the identity, rounded to a dot operand, as FLA's `solve_tril`),
   then W = T (beta exp(G) k) [L, K] and U = T (beta v) [L, V] as two products (heads of 64
   or more; narrower ones solve for W and U, see `default_config`), the decayed q k^T P, and
   what the walk multiplies by: k decayed to the chunk's end and exp(G_L);
2. `_gdn_chunk_walk_kernel` walks each sequence with two products a chunk, v_new = U - W S and
   the state update, and stores v_new and the state entering each chunk;
3. `_gdn_chunk_out_kernel`, a program per (chunk, value head), all in parallel, forms the
   outputs exp(G) q S + P v_new, and passes them through the layer's gated norm when given
   (its program holds a head's row).
Only the walk is a chain, so it is kept to what the recurrence needs: two products, the
conversions between them, and loads that Triton's pipeliner issues a chunk or two ahead (every
operand comes from memory; with the outputs in it, the walk of Qwen3.6-27B's heads over 8,192
tokens took ~690 us; recomputing the decayed k from k, a and b in it 469; reading it 328, see
`default_config`). W, U, P, v_new, the decayed k and the states go through memory in the
activation dtype. The fused form rounds its operands the same way but for T, U and W, which
it never forms: it solves for v_new itself; the two forms agree to the rounding of those.

Numerics (as FLA's kernels, which transformers runs on GPUs when they are installed): q and k normalised in fp32, then, for 16-bit
inputs, the dot operands in the activation dtype (q, k, the state entering k S and q S, the
decayed q k^T, v_new, the decayed k), fp32 accumulation, fp32 state between chunks; the solve
(the block inverses, N, c and the iteration) in TF32 for 16-bit inputs (FLA's default is IEEE
fp32 for its merge; TF32 keeps it on tensor cores at ~5e-4 relative, below the bf16 rounding of
the operands around it); the split form's T, W and U in the activation dtype, as FLA's (at
Qwen3.6-27B's heads over 8,192 tokens in bf16: 4.4e-3 relative error against the fp32
reference, against 4.1e-3 solving for W and U in TF32 and keeping U in fp32); fp32 inputs
multiply in `ieee` fp32 everywhere (tests against transformers' fp32 math). The decays exp(G_i - G_j) and exp(G_L - G_j) are exponentials of sums
over their own segments (a cumulative sum down the columns of the masked [64, 64] g, and a
reversed cumulative sum of the next tokens' g), not differences of prefix sums as transformers
and FLA compute them: with a strong decay (A = 16, g ~ -15 a token) G reaches -1000 within a
chunk, and its differences lose ~1e-4 of the exponents that still matter (those of nearby
tokens); g <= 0, so a segment sum is accurate relative to itself. exp(G_i) itself is taken from
the prefix sum (its absolute error only matters while exp(G_i) is not negligible).

Decode kernel: one program per (block of BLOCK_V columns, value head, sequence) reads its
[K, BLOCK_V] columns of the state once and writes them once (each written element depends on the
element read at the same address by the same program: an in-place update has no race); q, k
(K elements) are loaded and normalised by every program of the head. CUDA-graph capturable (no
host syncs, the grid depends only on S) and takes PDL like mamba_state_update.py.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.gated_rmsnorm import GatedRMSNorm, gated_norm_values, gated_rms_norm
from kernels.mamba_conv import _gather_pages
from kernels.mamba_ssd import _dot_operand, _first_ge, _num_sms, chunk_rounds
from kernels.pdl import pdl_args, pdl_wait

__all__ = ["GDN_MAX_CHUNK", "decode_config", "default_config", "gated_delta_update", "gated_delta_update_ref", "gated_delta_varlen",
           "gated_delta_varlen_ref"]

# The compute chunk is the host's chunk (1..GDN_MAX_CHUNK tokens, masked in a 64-row tile), the
# same partition as the Mamba path. 64: the row count of a Hopper wgmma tile and FLA's chunk size;
# 128 would double the quadratic part (k k^T, q k^T, the solve: L (K + V) per token) and not fit
# in registers, 32 would double the sequential chunk steps and put every product on mma.sync.
GDN_MAX_CHUNK = 64
_SUB = 16  # the solve's block (the smallest tl.dot dimension)
_EPS = 1e-6  # transformers' / FLA's l2norm eps


@triton.jit
def _softplus(x):
    # torch's softplus (threshold 20)
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)


@triton.jit
def _beta(b, DTYPE: tl.constexpr):
    """sigmoid(b) in fp32, rounded to b's dtype (transformers computes b.sigmoid() in it)."""
    return (1.0 / (1.0 + tl.exp(-b))).to(DTYPE).to(tl.float32)


@triton.jit
def _load_normed(ptr, t0l, head, s_t, s_h, n, K, scale, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows t0l..t0l+n of one head, L2-normalised in fp32 (eps 1e-6), times `scale`; zero rows
    past n."""
    l = tl.arange(0, BLOCK_L)
    kk = tl.arange(0, BLOCK_K)
    x = tl.load(ptr + t0l * s_t + head * s_h + l[:, None] * s_t + kk[None, :],
                mask=(l < n)[:, None] & (kk < K)[None, :], other=0.0).to(tl.float32)
    return x * (tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6) * scale)[:, None]


@triton.jit
def _chunk_gates(a_ptr, b_ptr, t0l, n, h, neg_A, dt_b, sa_t, sb_t, BLOCK_L: tl.constexpr):
    """(g, to_end, beta) of a chunk's n tokens: the log decays, the sum of the following tokens'
    g (to_end[j] = g_{j+1} + ... + g_L, from a shifted load: a sum over its own segment, accurate
    however strong the decay, where G_L - G_j would not be), and beta. Padding rows: no decay,
    no update (beta = 0)."""
    l = tl.arange(0, BLOCK_L)
    lm = l < n
    a_c = a_ptr + t0l * sa_t + h
    a = tl.load(a_c + l * sa_t, mask=lm, other=0.0).to(tl.float32)
    a_next = tl.load(a_c + (l + 1) * sa_t, mask=l + 1 < n, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t0l * sb_t + h + l * sb_t, mask=lm, other=0.0).to(tl.float32)
    g = tl.where(lm, neg_A * _softplus(a + dt_b), 0.0)
    g_next = tl.where(l + 1 < n, neg_A * _softplus(a_next + dt_b), 0.0)
    beta = tl.where(lm, _beta(b, b_ptr.dtype.element_ty), 0.0)
    return g, tl.cumsum(g_next, axis=0, reverse=True), beta


@triton.jit
def _chunk_qk(q_ptr, k_ptr, a_ptr, b_ptr, t0l, n, hk, h, neg_A, dt_b, scale,
              sq_t, sq_h, sk_t, sk_h, sa_t, sb_t, K,
              BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, DT: tl.constexpr, DOT_F32: tl.constexpr):
    """One chunk's state-independent operands: the normalised q (scaled) and k and k decayed to
    the chunk's end as dot operands, beta, exp(G) and exp(G_L), and the causal decay matrix
    exp(G_i - G_j)."""
    l = tl.arange(0, BLOCK_L)
    q = _load_normed(q_ptr, t0l, hk, sq_t, sq_h, n, K, scale, BLOCK_L, BLOCK_K)
    k = _load_normed(k_ptr, t0l, hk, sk_t, sk_h, n, K, 1.0, BLOCK_L, BLOCK_K)
    g, to_end, beta = _chunk_gates(a_ptr, b_ptr, t0l, n, h, neg_A, dt_b, sa_t, sb_t, BLOCK_L)
    # exp(G_i - G_j) as the exponential of g_{j+1} + ... + g_i, a segment sum (0 on and above the
    # diagonal), not a difference of prefix sums: with a strong decay G reaches -1000 within a
    # chunk and G_i - G_j would lose ~1e-4 of the exponents that matter (those of nearby tokens).
    seg = tl.cumsum(tl.where(l[:, None] > l[None, :], g[:, None], 0.0), axis=0)
    decay = tl.where(l[:, None] >= l[None, :], tl.exp(seg), 0.0)
    kd = _dot_operand(k, DT, DOT_F32)
    kw = _dot_operand(k * tl.exp(to_end)[:, None], DT, DOT_F32)
    qd = _dot_operand(q, DT, DOT_F32)
    return qd, kd, kw, beta, tl.exp(tl.cumsum(g, axis=0)), tl.exp(tl.sum(g, axis=0)), decay


@triton.jit
def _solve_blocks(A, BLOCK_L: tl.constexpr, SUB: tl.constexpr, LOG2_SUB: tl.constexpr, PREC: tl.constexpr):
    """(I + A) x = rhs for a strictly lower A [L, L], in 16-row blocks: Dinv, the inverses of the
    diagonal blocks by recursive doubling ([NB, SUB, SUB]), and N = Dinv E (E the strictly
    block-lower part of A, [L, L]); `_solve` then iterates x = Dinv rhs - N x."""
    l = tl.arange(0, BLOCK_L)
    NB: tl.constexpr = BLOCK_L // SUB
    bi = tl.arange(0, NB)
    diag_sel = bi[:, None, None, None] == bi[None, None, :, None]  # A as [NB, SUB, NB, SUB]: its diagonal blocks
    r = tl.arange(0, SUB)
    ri = r[None, :, None]
    rj = r[None, None, :]
    eye = tl.where(ri == rj, 1.0, 0.0) + tl.zeros([NB, SUB, SUB], tl.float32)
    Ad = tl.sum(tl.where(diag_sel, tl.reshape(A, (NB, SUB, NB, SUB)), 0.0), axis=2)  # [NB, SUB, SUB]
    Dinv = eye - tl.where(ri // 2 == rj // 2, Ad, 0.0)  # the inverses of the 2x2 blocks
    for lvl in tl.static_range(1, LOG2_SUB):
        # the lower off-diagonal w x w block of each 2w block (w = 2^lvl): X21 = -X22 D21 X11
        E = tl.where(((ri >> (lvl + 1)) == (rj >> (lvl + 1))) & ((ri >> lvl) != (rj >> lvl)), Ad, 0.0)
        Dinv = Dinv - tl.dot(Dinv, tl.dot(E, Dinv, input_precision=PREC), input_precision=PREC)
    blk = l // SUB
    E = tl.reshape(tl.where(blk[:, None] > blk[None, :], A, 0.0), (NB, SUB, BLOCK_L))
    Nm = tl.reshape(tl.dot(Dinv, E, input_precision=PREC), (BLOCK_L, BLOCK_L))
    return Dinv, Nm


@triton.jit
def _solve(Dinv, Nm, rhs, n, BLOCK_L: tl.constexpr, SUB: tl.constexpr, WIDTH: tl.constexpr, PREC: tl.constexpr):
    """x = (I + A)^-1 rhs for rhs [L, WIDTH] (block forward substitution: N is nilpotent, block i
    exact after i steps; the chunk's n rows need ceil(n / SUB) - 1)."""
    NB: tl.constexpr = BLOCK_L // SUB
    c = tl.reshape(tl.dot(Dinv, tl.reshape(rhs, (NB, SUB, WIDTH)), input_precision=PREC), (BLOCK_L, WIDTH))
    x = c
    for _ in range(1, (n + SUB - 1) // SUB):
        x = c - tl.dot(Nm, x, input_precision=PREC)
    return x


# The batch shape changes every step: no specialisation on these values (== 1, divisible by 16).
@triton.jit(do_not_specialize=["num_chunks"])
def _gdn_varlen_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, out_ptr, state_ptr,
    qsl_ptr, init_ptr, cstart_ptr, cpage_ptr,
    num_chunks, K, V, v_per_k, scale,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sa_t, sb_t, so_t, so_h, st_page, st_h, st_k,
    BLOCK_L: tl.constexpr, SUB: tl.constexpr, LOG2_SUB: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    seq_start = tl.load(qsl_ptr + s)
    seq_end = tl.load(qsl_ptr + s + 1)
    if seq_start >= seq_end:
        return
    hk = h // v_per_k
    DT: tl.constexpr = v_ptr.dtype.element_ty
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    l = tl.arange(0, BLOCK_L)
    km = kk < K
    vm = vv < V
    st_off = kk[:, None] * st_k + vv[None, :]  # inside the head's [K, V] block of a page
    st_mask = km[:, None] & vm[None, :]

    page = tl.load(init_ptr + s).to(tl.int64)
    ok = st_mask & (tl.zeros(st_mask.shape, tl.int64) + page > 0)  # (the interpreter rejects mask & scalar)
    state = tl.load(state_ptr + page * st_page + h * st_h + st_off, mask=ok, other=0.0).to(tl.float32)
    neg_A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_b = tl.load(dtb_ptr + h).to(tl.float32)
    strict = l[:, None] > l[None, :]

    c_begin = _first_ge(cstart_ptr, num_chunks, seq_start)
    c_end = _first_ge(cstart_ptr, num_chunks, seq_end)
    for c in range(c_begin, c_end):
        t0 = tl.load(cstart_ptr + c)
        n = tl.load(cstart_ptr + c + 1) - t0
        lm = l < n
        t0l = t0.to(tl.int64)
        v = tl.load(v_ptr + t0l * sv_t + h * sv_h + l[:, None] * sv_t + vv[None, :], mask=lm[:, None] & vm[None, :],
                    other=0.0).to(tl.float32)
        qd, kd, kw, beta, eG, eGL, decay = _chunk_qk(q_ptr, k_ptr, a_ptr, b_ptr, t0l, n, hk, h, neg_A, dt_b, scale,
                                                     sq_t, sq_h, sk_t, sk_h, sa_t, sb_t, K,
                                                     BLOCK_L, BLOCK_K, DT, DOT_F32)
        # Ordered so that few [64, .] tiles are alive at once (the program is at the register
        # limit): the decays are consumed into A and P first.
        P = _dot_operand(tl.dot(qd, tl.trans(kd), input_precision=PRECISION) * decay, DT, DOT_F32)
        A = tl.where(strict, tl.dot(kd, tl.trans(kd), input_precision=PRECISION) * decay, 0.0) * beta[:, None]
        Dinv, Nm = _solve_blocks(A, BLOCK_L, SUB, LOG2_SUB, SOLVE_PRECISION)

        # the state entering the chunk: read by q (decayed to each position) and by k
        Sd = _dot_operand(state, DT, DOT_F32)
        o_in = tl.dot(qd, Sd, input_precision=PRECISION) * eG[:, None]
        kS = tl.dot(kd, Sd, input_precision=PRECISION)
        # v_new = (I + A)^-1 (beta (v - exp(G) k S))
        x = _solve(Dinv, Nm, beta[:, None] * (v - eG[:, None] * kS), n, BLOCK_L, SUB, BLOCK_V, SOLVE_PRECISION)
        xd = _dot_operand(x, DT, DOT_F32)

        # outputs: the state entering the chunk plus the intra-chunk part
        o = tl.dot(P, xd, o_in, input_precision=PRECISION)
        tl.store(out_ptr + t0l * so_t + h * so_h + l[:, None] * so_t + vv[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=lm[:, None] & vm[None, :])

        # the state after the chunk
        state = tl.dot(tl.trans(kw), xd, state * eGL, input_precision=PRECISION)
        wpage = tl.load(cpage_ptr + c).to(tl.int64)
        if wpage > 0:
            tl.store(state_ptr + wpage * st_page + h * st_h + st_off, state, mask=st_mask)


@triton.jit
def _gdn_chunk_prep_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, w_ptr, kw_ptr, egl_ptr, u_ptr, p_ptr, cstart_ptr,
    K, V, v_per_k, scale,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sa_t, sb_t, sw_t, sw_h, se_c, su_t, su_h, sp_c, sp_h,
    BLOCK_L: tl.constexpr, SUB: tl.constexpr, LOG2_SUB: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, SOLVE_PRECISION: tl.constexpr,
    FORM_T: tl.constexpr,
):
    """Phase 1 of the split prefill, one program per (chunk, value head), all in parallel: what
    a chunk needs that does not depend on the state entering it. With T = (I + A)^-1:
    W = T (beta exp(G) k) [L, K], U = T (beta v) [L, V], the decayed causal q k^T P [L, L],
    k exp(G_L - G) [L, K] (all DT) and exp(G_L), so that phase 2 computes v_new = U - W S and
    the next state from loads alone. FORM_T: T formed and rounded to DT, W and U its products;
    else W and U solved for."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // v_per_k
    DT: tl.constexpr = v_ptr.dtype.element_ty
    t0 = tl.load(cstart_ptr + c)
    n = tl.load(cstart_ptr + c + 1) - t0
    t0l = t0.to(tl.int64)
    l = tl.arange(0, BLOCK_L)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.arange(0, BLOCK_V)
    lm = l < n
    neg_A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_b = tl.load(dtb_ptr + h).to(tl.float32)
    qd, kd, kw, beta, eG, eGL, decay = _chunk_qk(q_ptr, k_ptr, a_ptr, b_ptr, t0l, n, hk, h, neg_A, dt_b, scale,
                                                 sq_t, sq_h, sk_t, sk_h, sa_t, sb_t, K, BLOCK_L, BLOCK_K, DT, DOT_F32)
    # stored at once, so that kw's registers are free for the solves (498 us against 509 stored last)
    tile = lm[:, None] & (kk < K)[None, :]
    rows = t0l * sw_t + h * sw_h + l[:, None] * sw_t + kk[None, :]  # W's and the decayed k's
    tl.store(kw_ptr + rows, kw.to(DT), mask=tile)
    tl.store(egl_ptr + c.to(tl.int64) * se_c + h, eGL)
    P = tl.dot(qd, tl.trans(kd), input_precision=PRECISION) * decay
    tl.store(p_ptr + c.to(tl.int64) * sp_c + h * sp_h + l[:, None] * BLOCK_L + l[None, :], P.to(DT))
    strict = l[:, None] > l[None, :]
    A = tl.where(strict, tl.dot(kd, tl.trans(kd), input_precision=PRECISION) * decay, 0.0) * beta[:, None]
    Dinv, Nm = _solve_blocks(A, BLOCK_L, SUB, LOG2_SUB, SOLVE_PRECISION)
    kb = (beta * eG)[:, None] * kd.to(tl.float32)
    vmask = lm[:, None] & (vv < V)[None, :]
    v = tl.load(v_ptr + t0l * sv_t + h * sv_h + l[:, None] * sv_t + vv[None, :], mask=vmask, other=0.0).to(tl.float32)
    if FORM_T:
        # T itself (the solve against the identity), rounded to a dot operand: two products instead
        # of solving for W and U, whose right-hand sides are twice T's width
        eye = tl.where(l[:, None] == l[None, :], 1.0, 0.0)
        T = _dot_operand(_solve(Dinv, Nm, eye, n, BLOCK_L, SUB, BLOCK_L, SOLVE_PRECISION), DT, DOT_F32)
        W = tl.dot(T, _dot_operand(kb, DT, DOT_F32), input_precision=PRECISION)
        U = tl.dot(T, _dot_operand(beta[:, None] * v, DT, DOT_F32), input_precision=PRECISION)
    else:
        W = _solve(Dinv, Nm, kb, n, BLOCK_L, SUB, BLOCK_K, SOLVE_PRECISION)
        U = _solve(Dinv, Nm, beta[:, None] * v, n, BLOCK_L, SUB, BLOCK_V, SOLVE_PRECISION)
    tl.store(w_ptr + rows, W.to(DT), mask=tile)
    tl.store(u_ptr + t0l * su_t + h * su_h + l[:, None] * su_t + vv[None, :], U.to(DT), mask=vmask)


@triton.jit(do_not_specialize=["num_chunks"])
def _gdn_chunk_walk_kernel(
    kw_ptr, egl_ptr, w_ptr, u_ptr, x_ptr, snap_ptr, state_ptr,
    qsl_ptr, init_ptr, cstart_ptr, cpage_ptr,
    num_chunks, K, V,
    sw_t, sw_h, su_t, su_h, sx_t, sx_h, sn_c, sn_h, se_c, st_page, st_h, st_k,
    BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr, STAGES: tl.constexpr,
):
    """Phase 2 of the split prefill, one program per (sequence, value head, BLOCK_V state
    columns), walking the sequence's chunks in order with two products a chunk: v_new = U - W S
    and S' = exp(G_L) S + (k exp(G_L - G))^T v_new. It leaves the outputs to phase 3: it stores
    each chunk's v_new and the state entering it (as the dot operand it is, in the activation
    dtype); checkpoints as the fused kernel writes them. The decayed k is laid out as W (their
    strides sw_t, sw_h)."""
    s = tl.program_id(0)
    h = tl.program_id(1)
    seq_start = tl.load(qsl_ptr + s)
    seq_end = tl.load(qsl_ptr + s + 1)
    if seq_start >= seq_end:
        return
    DT: tl.constexpr = x_ptr.dtype.element_ty
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    l = tl.arange(0, BLOCK_L)
    km = kk < K
    vm = vv < V
    st_off = kk[:, None] * st_k + vv[None, :]
    st_mask = km[:, None] & vm[None, :]
    page = tl.load(init_ptr + s).to(tl.int64)
    ok = st_mask & (tl.zeros(st_mask.shape, tl.int64) + page > 0)
    state = tl.load(state_ptr + page * st_page + h * st_h + st_off, mask=ok, other=0.0).to(tl.float32)
    c_begin = _first_ge(cstart_ptr, num_chunks, seq_start)
    c_end = _first_ge(cstart_ptr, num_chunks, seq_end)
    for c in tl.range(c_begin, c_end, num_stages=STAGES):
        t0 = tl.load(cstart_ptr + c)
        n = tl.load(cstart_ptr + c + 1) - t0
        lm = l < n
        t0l = t0.to(tl.int64)
        tile = lm[:, None] & km[None, :]
        cl = c + tl.zeros([], tl.int64)
        wpage = tl.load(cpage_ptr + c).to(tl.int64)
        rows = t0l * sw_t + h * sw_h + l[:, None] * sw_t + kk[None, :]
        kw = tl.load(kw_ptr + rows, mask=tile, other=0.0)
        eGL = tl.load(egl_ptr + cl * se_c + h)
        W = tl.load(w_ptr + rows, mask=tile, other=0.0)
        U = tl.load(u_ptr + t0l * su_t + h * su_h + l[:, None] * su_t + vv[None, :], mask=lm[:, None] & vm[None, :],
                    other=0.0).to(tl.float32)
        if DOT_F32:
            kw, W = kw.to(tl.float32), W.to(tl.float32)
        Sd = _dot_operand(state, DT, DOT_F32)
        tl.store(snap_ptr + cl * sn_c + h * sn_h + st_off, Sd.to(DT), mask=st_mask)
        x = U - tl.dot(W, Sd, input_precision=PRECISION)
        xd = _dot_operand(x, DT, DOT_F32)
        tl.store(x_ptr + t0l * sx_t + h * sx_h + l[:, None] * sx_t + vv[None, :], xd.to(DT),
                 mask=lm[:, None] & vm[None, :])
        state = tl.dot(tl.trans(kw), xd, state * eGL, input_precision=PRECISION)
        if wpage > 0:
            tl.store(state_ptr + wpage * st_page + h * st_h + st_off, state, mask=st_mask)


@triton.jit
def _gdn_chunk_out_kernel(q_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, p_ptr, x_ptr, snap_ptr, out_ptr, cstart_ptr,
                          z_ptr, nw_ptr, eps, K, V, v_per_k, scale,
                          sq_t, sq_h, sa_t, sb_t, sp_c, sp_h, sx_t, sx_h, sn_c, sn_h, sn_k, so_t, so_h, sz_t,
                          BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                          DOT_F32: tl.constexpr, PRECISION: tl.constexpr, NORM: tl.constexpr,
                          NORM_BEFORE_GATE: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr):
    """Phase 3 of the split prefill, one program per (chunk, value head, BLOCK_V columns), all in
    parallel: o = exp(G) q S + P v_new from the state entering the chunk and v_new that phase 2
    stored (the same rounded operands as the fused kernel's products). NORM (a program holds its
    head's V columns): the gated RMSNorm of each head's output row, gated by z `[T, Hv V]` with
    the weight `[Hv V]`, applied to o rounded to the output dtype, as its own launch would."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // v_per_k
    DT: tl.constexpr = out_ptr.dtype.element_ty
    t0 = tl.load(cstart_ptr + c)
    n = tl.load(cstart_ptr + c + 1) - t0
    t0l = t0.to(tl.int64)
    cl = c.to(tl.int64)
    l = tl.arange(0, BLOCK_L)
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    lm = l < n
    km = kk < K
    vm = vv < V
    neg_A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_b = tl.load(dtb_ptr + h).to(tl.float32)
    g, _to_end, _beta = _chunk_gates(a_ptr, b_ptr, t0l, n, h, neg_A, dt_b, sa_t, sb_t, BLOCK_L)
    eG = tl.exp(tl.cumsum(g, axis=0))
    qd = _dot_operand(_load_normed(q_ptr, t0l, hk, sq_t, sq_h, n, K, scale, BLOCK_L, BLOCK_K), DT, DOT_F32)
    Sd = tl.load(snap_ptr + cl * sn_c + h * sn_h + kk[:, None] * sn_k + vv[None, :], mask=km[:, None] & vm[None, :],
                 other=0.0)
    xd = tl.load(x_ptr + t0l * sx_t + h * sx_h + l[:, None] * sx_t + vv[None, :], mask=lm[:, None] & vm[None, :],
                 other=0.0)
    P = tl.load(p_ptr + cl * sp_c + h * sp_h + l[:, None] * BLOCK_L + l[None, :])
    if NORM:
        ch = h * V + vv
        z = tl.load(z_ptr + t0l * sz_t + l[:, None] * sz_t + ch[None, :], mask=lm[:, None] & vm[None, :], other=0.0)
        w = tl.load(nw_ptr + ch, mask=vm, other=0.0).to(tl.float32)
    if DOT_F32:
        Sd, xd, P = Sd.to(tl.float32), xd.to(tl.float32), P.to(tl.float32)
    o = tl.dot(qd, Sd, input_precision=PRECISION) * eG[:, None]
    o = tl.dot(P, xd, o, input_precision=PRECISION).to(DT)
    if NORM:
        o = gated_norm_values(o.to(tl.float32), z.to(tl.float32), w[None, :], V, eps, NORM_BEFORE_GATE,
                              ROUND_BEFORE_WEIGHT, DT)
    tl.store(out_ptr + t0l * so_t + h * so_h + l[:, None] * so_t + vv[None, :], o, mask=lm[:, None] & vm[None, :])


@triton.jit
def _gdn_update_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, out_ptr, state_ptr, init_ptr, write_ptr,
                       K, V, v_per_k, scale,
                       sq_s, sq_h, sk_s, sk_h, sv_s, sv_h, sa_s, sb_s, so_s, so_h, st_page, st_h, st_k,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    # The pages, the state and the layer's weights are read before the PDL wait: the step's
    # metadata and the previous step's state come from kernels at least two launches back, done
    # by then (kernels/pdl.py); the projection and conv just before write neither.
    # Grid (column blocks, value heads, sequences): a state's column blocks run side by side, so
    # its rows, split between them, leave DRAM together; the state streams through L2 once
    # (evict-first loads, streaming stores). H200, batch 128 x 48 heads: 204 us against 218 for
    # sequences first and default caching (either change alone: 216).
    s = tl.program_id(2).to(tl.int64)
    h = tl.program_id(1)
    hk = h // v_per_k
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    km = kk < K
    vm = vv < V
    m2 = km[:, None] & vm[None, :]
    src = tl.load(init_ptr + s).to(tl.int64)
    dst = tl.load(write_ptr + s).to(tl.int64)
    st_off = h * st_h + kk[:, None] * st_k + vv[None, :]
    ok = m2 & (tl.zeros(m2.shape, tl.int64) + src > 0)  # (the interpreter rejects mask & scalar)
    state = tl.load(state_ptr + src * st_page + st_off, mask=ok, other=0.0, eviction_policy="evict_first").to(tl.float32)
    neg_A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))  # (weights: before the wait too)
    dt_b = tl.load(dtb_ptr + h).to(tl.float32)
    pdl_wait(PDL)

    q = tl.load(q_ptr + s * sq_s + hk * sq_h + kk, mask=km, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + s * sk_s + hk * sk_h + kk, mask=km, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + s * sv_s + h * sv_h + vv, mask=vm, other=0.0).to(tl.float32)
    q = q * (tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale)
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    a = tl.load(a_ptr + s * sa_s + h).to(tl.float32)
    b = tl.load(b_ptr + s * sb_s + h).to(tl.float32)
    g = neg_A * _softplus(a + dt_b)
    beta = _beta(b, b_ptr.dtype.element_ty)

    state = state * tl.exp(g)
    delta = beta * (v - tl.sum(state * k[:, None], axis=0))
    state = state + k[:, None] * delta[None, :]
    if dst > 0:
        tl.store(state_ptr + dst * st_page + st_off, state, mask=m2, cache_modifier=".cs")
    o = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + s * so_s + h * so_h + vv, o.to(out_ptr.dtype.element_ty), mask=vm)


# ----------------------------------------------------------------------------- wrappers

def _check(q, k, v, a, b, A_log, dt_bias, state) -> tuple[int, int, int, int, int]:
    """(tokens, key heads, value heads, K, V), the shapes checked."""
    T, Hk, K = q.shape
    Hv, V = v.shape[1], v.shape[2]
    assert k.shape == (T, Hk, K) and v.shape == (T, Hv, V) and Hv % Hk == 0, (q.shape, k.shape, v.shape)
    assert a.shape == (T, Hv) and b.shape == (T, Hv), (a.shape, b.shape)
    assert A_log.shape == (Hv,) and dt_bias.shape == (Hv,), (A_log.shape, dt_bias.shape)
    assert state.dim() == 4 and state.shape[1:] == (Hv, K, V), (state.shape, Hv, K, V)
    return T, Hk, Hv, K, V


def _check_kernel_operands(q, k, v, a, b, state) -> None:
    assert v.dtype in (torch.bfloat16, torch.float16, torch.float32), v.dtype
    assert q.dtype == v.dtype and k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    for t in (q, k, v, a, b):
        assert t.stride(-1) == 1, "inputs need a unit last stride"
    assert state.dtype == torch.float32 and state.stride(3) == 1, (state.dtype, state.stride())


def _check_norm(norm: GatedRMSNorm | None, T: int, Hv: int, V: int, dtype: torch.dtype) -> None:
    if norm is None:
        return
    if norm.group_size != V or tuple(norm.z.shape) != (T, Hv * V) or tuple(norm.weight.shape) != (Hv * V,):
        raise ValueError(f"gated_delta_varlen: the norm must take groups of V={V} over z [T, Hv*V] = {(T, Hv * V)} "
                         f"with a weight [{Hv * V}], not groups of {norm.group_size}, z {tuple(norm.z.shape)}, "
                         f"weight {tuple(norm.weight.shape)}")
    if norm.z.stride(-1) != 1 or norm.z.dtype != dtype:
        raise ValueError(f"gated_delta_varlen: the norm's z must be {dtype} with a unit column stride")


def default_config(K: int, V: int, num_seqs_x_heads: int, device: torch.device, split: bool | None = None,
                   itemsize: int = 2) -> dict:
    """BLOCK_V, launch options and the form of the prefill. A program holds its state [K, BLOCK_V]
    (fp32), q and k [64, K], v and v_new [64, BLOCK_V] and three [64, 64] matrices (A, N, the
    decayed q k^T): at K = 128, BLOCK_V = 64 is ~32K fp32 values, 8 warps. BLOCK_V stays at 64
    even when a batch-1 prefill fills only part of the GPU: on an H200 with Triton 3.6, bf16
    operands at K = V = 128 with BLOCK_V 32 faulted (8 warps: an invalid shared-memory read under
    compute-sanitizer) or gave wrong outputs (4 warps, or an IEEE solve: relative error 0.5-0.9),
    and BLOCK_V 16 gave wrong outputs, while fp32 operands, K = 32, and BLOCK_V = 64 (4 or 8
    warps) were right; `gated_delta_varlen` refuses those launches.

    `split`: when the fused kernel's programs (a sequence's chunks walked in order by each) would
    not fill the GPU four times over (a long prompt alone, a few prompts), the split form runs
    (the module docstring), at the price of writing and reading W, U, P, v_new, the decayed k
    and a state a chunk (about 1.7 KB per token and value head at K = V = 128, all in the
    activation dtype). Its walk's programs take 32 state columns on 4 warps (the bf16 faults
    above are the fused kernel's, whose programs also solve), their loads pipelined 3 deep
    ("walk_stages": the loop's `num_stages`; 1, no pipelining, gave wrong outputs on an H200 with
    Triton 3.6 and is refused), and its solves 4 warps. These form T for 16-bit operands of K and V of at least 64
    ("prep_form_t"; every published checkpoint has 128): at K = 24 and V = 16 in bf16 that launch
    faulted on an H200 with Triton 3.6 (an illegal memory access), so narrower heads solve for W
    and U. `split` given: that form's launch. Pass `config=` to override any of it ("prep_warps":
    the solves' launch)."""
    bv = min(64, max(16, triton.next_power_of_2(V)))
    bk = max(16, triton.next_power_of_2(K))
    sms = _num_sms(device) if device.type == "cuda" else 132
    if split is None:
        split = num_seqs_x_heads * triton.cdiv(V, bv) < 4 * sms
    if split:
        # H200, one 8,192-token sequence, Qwen3.6-27B's heads (16 key, 48 value; `python -m
        # kernels.bench.gated_delta --sweep`), us: the solves 496 on 4 warps against 814 on 8;
        # the walk 477 with 32 columns on 4 warps, 588 with 64 on 8, 695 with 64 on 4, 912 with
        # 32 on 2 (the walk with the outputs in it: ~690 with 64 on 8). With the decayed k read
        # rather than recomputed: the walk 328 (the solves 498 against 452 for the extra store;
        # the three launches 985 against 1,075), 3 stages; 2 stages 332, 4 328; 64 columns on 8
        # warps ~600 (the decayed k recomputed and its loads pipelined: 532-548). The solves with
        # T formed and W, U as its products: 381 against 503 (8 warps 572); the walk with the
        # state in two K halves (FLA's) 323-326, transposed (both products' left operand in
        # registers) 363-375 with 64 columns.
        return {"BLOCK_V": min(32, bv), "num_warps": 4, "num_stages": 2, "split": True, "prep_warps": 4,
                "walk_stages": 3, "prep_form_t": itemsize == 2 and min(bk, V) >= 64}
    # H200, K = V = 128, 32 heads: the fused kernel over 8 x 1,024 tokens 0.98 ms with 4 warps
    # against 1.22 with 8.
    warps = 4
    return {"BLOCK_V": bv, "num_warps": warps, "num_stages": 2, "split": False}


def decode_config(K: int, V: int, programs_per_column_block: int, device: torch.device) -> dict:
    """BLOCK_V and warps of the decode kernel: the widest column block (64 fp32 columns: 256-byte
    rows of the state read and written) that still gives two programs per SM; a small batch
    (batch 1: one program per 16 columns of each head) takes narrow blocks of one warp. Measured
    on an H200 at K = V = 128, 32 heads (`python -m kernels.bench.gated_delta --sweep`): batch
    128 at 82% of the copy bandwidth with 64 columns and 4 warps against 44% with 16 and 4 (90%,
    92% at 48 heads, since the grid runs a state's column blocks side by side, with streaming loads
    and stores)."""
    bk = triton.next_power_of_2(K)
    sms = _num_sms(device) if device.type == "cuda" else 132
    widths = [w for w in (64, 32, 16) if w <= max(16, triton.next_power_of_2(V)) and bk * w <= 8192] or [16]
    bv = next((w for w in widths if programs_per_column_block * triton.cdiv(V, w) >= 2 * sms), widths[-1])
    warps = 4 if bk * bv >= 4096 else 2 if bk * bv >= 2048 else 1
    return {"BLOCK_V": bv, "num_warps": warps}


def _interpreter_bf16(t: torch.Tensor) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and t.dtype == torch.bfloat16


def gated_delta_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor,
                       init_page: torch.Tensor, chunk_start: torch.Tensor, chunk_seq: torch.Tensor,
                       chunk_page: torch.Tensor, out: torch.Tensor | None = None,
                       config: dict | None = None, norm: GatedRMSNorm | None = None) -> torch.Tensor:
    """Prefill over a ragged batch. q, k `[T, Hk, K]`, v `[T, Hv, V]`, a, b `[T, Hv]` (raw
    projections), A_log, dt_bias `[Hv]` fp32; `state[num_pages, Hv, K, V]` fp32 is read at
    init_page[s] (<= 0: zeros) and written after every chunk with chunk_page > 0. Chunks:
    `chunk_start[NC+1]`, `chunk_seq[NC]`, 1..GDN_MAX_CHUNK tokens each, never crossing a
    sequence. Inputs may be strided views with a unit last stride. Returns out `[T, Hv, V]` in
    v's dtype: the outputs, or with `norm` (groups of V, a value head each: the layer's gated
    norm, z `[T, Hv V]`) the outputs through it, which the split form applies in its output
    launch."""
    T, Hk, Hv, K, V = _check(q, k, v, a, b, A_log, dt_bias, state)
    _check_kernel_operands(q, k, v, a, b, state)
    _check_norm(norm, T, Hv, V, v.dtype)
    S = init_page.shape[0]
    NC = chunk_seq.shape[0]
    assert query_start_loc.shape == (S + 1,) and chunk_start.shape == (NC + 1,) and chunk_page.shape == (NC,)
    if out is None:
        out = torch.empty((T, Hv, V), dtype=v.dtype, device=v.device)
    assert out.shape == (T, Hv, V) and out.stride(-1) == 1
    if S == 0 or NC == 0:
        return out
    cfg = {**default_config(K, V, S * Hv, v.device, (config or {}).get("split"), v.element_size()), **(config or {})}
    block_v = cfg["BLOCK_V"]
    if not cfg["split"] and v.dtype != torch.float32 and K > 32 and block_v < min(64, V) and v.device.type == "cuda":
        raise ValueError(f"gated_delta_varlen: BLOCK_V={block_v} with {v.dtype} operands and K={K} is refused: on an "
                         f"H200 with Triton 3.6 such launches faulted (an invalid shared-memory read) or gave wrong "
                         f"outputs (relative error 0.5-0.9); BLOCK_V=64 runs")
    if cfg["split"] and cfg["walk_stages"] < 2 and v.device.type == "cuda":
        raise ValueError(f"gated_delta_varlen: walk_stages={cfg['walk_stages']} is refused: on an H200 with Triton "
                         f"3.6 the split form's walk without pipelined loads gave wrong outputs (bf16 operands, "
                         f"K = V = 128: relative error 0.2-0.3); walk_stages=2 or more runs")
    common = dict(BLOCK_L=GDN_MAX_CHUNK, BLOCK_K=max(16, triton.next_power_of_2(K)), DOT_F32=_interpreter_bf16(v),
                  PRECISION="ieee" if v.dtype == torch.float32 else "tf32")
    solve = dict(SUB=_SUB, LOG2_SUB=_SUB.bit_length() - 1,
                 SOLVE_PRECISION="ieee" if v.dtype == torch.float32 else "tf32")
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    launch = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    grid = (S, Hv, triton.cdiv(V, block_v))
    out_v = min(128, max(16, triton.next_power_of_2(V)))
    if norm is not None and (not cfg["split"] or out_v < V):  # no launch holds a head's row: the norm's own
        gated_delta_varlen(q, k, v, a, b, A_log, dt_bias, state, query_start_loc, init_page, chunk_start, chunk_seq,
                           chunk_page, out=out, config=config)
        flat = out.view(T, Hv * V)
        gated_rms_norm(flat, norm.z, norm.weight, norm.group_size, norm.eps, norm.norm_before_gate,
                       norm.round_before_weight, out=flat)
        return out
    if not cfg["split"]:
        _gdn_varlen_kernel[grid](
            q, k, v, a, b, A_log, dt_bias, out, state, query_start_loc, init_page, chunk_start, chunk_page,
            NC, K, V, Hv // Hk, K ** -0.5, *strides, v.stride(0), v.stride(1), a.stride(0), b.stride(0),
            out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2),
            BLOCK_V=block_v, **common, **solve, **launch)
        return out
    L = GDN_MAX_CHUNK
    w = torch.empty((T, Hv, K), dtype=v.dtype, device=v.device)
    kw = torch.empty_like(w)
    egl = torch.empty((NC, Hv), dtype=torch.float32, device=v.device)
    u = torch.empty((T, Hv, V), dtype=v.dtype, device=v.device)
    p = torch.empty((NC, Hv, L, L), dtype=v.dtype, device=v.device)
    _gdn_chunk_prep_kernel[(NC, Hv)](
        q, k, v, a, b, A_log, dt_bias, w, kw, egl, u, p, chunk_start, K, V, Hv // Hk, K ** -0.5,
        *strides, v.stride(0), v.stride(1), a.stride(0), b.stride(0), w.stride(0), w.stride(1), egl.stride(0),
        u.stride(0), u.stride(1), p.stride(0), p.stride(1), BLOCK_V=max(16, triton.next_power_of_2(V)), **common,
        **solve, FORM_T=cfg["prep_form_t"], num_warps=cfg.get("prep_warps", 4), num_stages=1)
    x = torch.empty((T, Hv, V), dtype=v.dtype, device=v.device)
    snap = torch.empty((NC, Hv, K, V), dtype=v.dtype, device=v.device)
    _gdn_chunk_walk_kernel[grid](
        kw, egl, w, u, x, snap, state, query_start_loc, init_page, chunk_start, chunk_page,
        NC, K, V, w.stride(0), w.stride(1), u.stride(0), u.stride(1), x.stride(0), x.stride(1),
        snap.stride(0), snap.stride(1), egl.stride(0), state.stride(0), state.stride(1), state.stride(2),
        BLOCK_V=block_v, STAGES=cfg["walk_stages"], **common, **launch)
    z, nw = (norm.z, norm.weight) if norm is not None else (out, out)
    _gdn_chunk_out_kernel[(NC, Hv, triton.cdiv(V, out_v))](
        q, a, b, A_log, dt_bias, p, x, snap, out, chunk_start, z, nw, norm.eps if norm is not None else 0.0,
        K, V, Hv // Hk, K ** -0.5,
        q.stride(0), q.stride(1), a.stride(0), b.stride(0), p.stride(0), p.stride(1), x.stride(0), x.stride(1),
        snap.stride(0), snap.stride(1), snap.stride(2), out.stride(0), out.stride(1), z.stride(0),
        BLOCK_V=out_v, **common, NORM=norm is not None, NORM_BEFORE_GATE=norm is not None and norm.norm_before_gate,
        ROUND_BEFORE_WEIGHT=norm is not None and norm.round_before_weight, num_warps=4, num_stages=2)
    return out


def gated_delta_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, init_page: torch.Tensor,
                       write_page: torch.Tensor, out: torch.Tensor | None = None,
                       config: dict | None = None) -> torch.Tensor:
    """One decode step for S sequences: q, k `[S, Hk, K]`, v `[S, Hv, V]`, a, b `[S, Hv]`; the
    state is read at init_page[s] (<= 0: zeros) and written to write_page[s] (<= 0: not
    written; may equal init_page). Returns out `[S, Hv, V]` in v's dtype. `config`:
    {"BLOCK_V", "num_warps"} to override the launch."""
    S, Hk, Hv, K, V = _check(q, k, v, a, b, A_log, dt_bias, state)
    _check_kernel_operands(q, k, v, a, b, state)
    assert init_page.shape == (S,) and write_page.shape == (S,)
    if out is None:
        out = torch.empty((S, Hv, V), dtype=v.dtype, device=v.device)
    assert out.shape == (S, Hv, V) and out.stride(-1) == 1
    if S == 0:
        return out
    if S > 65535:  # the grid's third dimension
        raise ValueError(f"gated_delta_update takes at most 65,535 sequences a launch, got {S}")
    block_k = triton.next_power_of_2(K)
    cfg = {**decode_config(K, V, S * Hv, v.device), **(config or {})}
    _gdn_update_kernel[(triton.cdiv(V, cfg["BLOCK_V"]), Hv, S)](
        q, k, v, a, b, A_log, dt_bias, out, state, init_page, write_page,
        K, V, Hv // Hk, K ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
        out.stride(0), out.stride(1), state.stride(0), state.stride(1), state.stride(2),
        BLOCK_K=block_k, BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"], **pdl_args(v))
    return out


# ----------------------------------------------------------------------------- references

def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + _EPS)  # transformers' l2norm


def _prepare(q, k, a, b, A_log, dt_bias, Hv: int, acc: torch.dtype, divide: bool):
    """q (normalised, scaled), k (normalised) expanded to the value heads, g and beta, in `acc`,
    with transformers' operations (its recurrent form divides q by sqrt(K), the chunked form
    multiplies by K^-0.5: `divide`)."""
    rep = Hv // q.shape[1]
    K = q.shape[-1]
    qf = _l2norm(q.to(acc))
    qf = qf / K ** 0.5 if divide else qf * K ** -0.5
    kf = _l2norm(k.to(acc))
    if rep > 1:
        qf, kf = qf.repeat_interleave(rep, dim=1), kf.repeat_interleave(rep, dim=1)
    g = -A_log.to(acc).exp() * F.softplus(a.to(acc) + dt_bias.to(acc))
    beta = b.sigmoid().to(acc)  # in b's dtype, as transformers
    return qf, kf, g, beta


def gated_delta_update_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, init_page: torch.Tensor,
                           write_page: torch.Tensor, out: torch.Tensor | None = None,
                           config: dict | None = None) -> torch.Tensor:
    """Same contract as `gated_delta_update` (`config` is ignored): transformers'
    torch_recurrent_gated_delta_rule step, vectorised over the sequences and heads (fp32; fp64
    for fp64 inputs; any state dtype)."""
    S, _Hk, Hv, _K, V = _check(q, k, v, a, b, A_log, dt_bias, state)
    assert init_page.shape == (S,) and write_page.shape == (S,)
    acc = torch.promote_types(v.dtype, torch.float32)
    if out is None:
        out = torch.empty((S, Hv, V), dtype=v.dtype, device=v.device)
    if S == 0:
        return out
    qf, kf, g, beta = _prepare(q, k, a, b, A_log, dt_bias, Hv, acc, divide=True)
    h = _gather_pages(state, init_page, acc)  # [S, Hv, K, V]; read before any write
    h = h * g.exp()[..., None, None]
    kv_mem = (h * kf[..., None]).sum(dim=-2)
    delta = (v.to(acc) - kv_mem) * beta[..., None]
    h = h + kf[..., None] * delta[..., None, :]
    o = (h * qf[..., None]).sum(dim=-2)
    page = write_page.long()
    keep = page > 0
    state[page[keep]] = h[keep].to(state.dtype)
    out.copy_(o)
    return out


def gated_delta_varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                           query_start_loc: torch.Tensor, init_page: torch.Tensor, chunk_start: torch.Tensor,
                           chunk_seq: torch.Tensor, chunk_page: torch.Tensor, out: torch.Tensor | None = None,
                           config: dict | None = None, norm: GatedRMSNorm | None = None) -> torch.Tensor:
    """Same contract as `gated_delta_varlen` (`config` is ignored), on the given chunks, each
    with transformers' torch_chunk_gated_delta_rule arithmetic (fp32; fp64 for fp64 inputs; any
    state dtype). The k-th chunks of all sequences are processed together (a loop over the
    longest sequence's chunk count), vectorised over the chunk's tokens, the heads and the
    sequences."""
    T, _Hk, Hv, _K, V = _check(q, k, v, a, b, A_log, dt_bias, state)
    _check_norm(norm, T, Hv, V, v.dtype)
    S = init_page.shape[0]
    NC = chunk_seq.shape[0]
    assert query_start_loc.shape == (S + 1,) and chunk_start.shape == (NC + 1,) and chunk_page.shape == (NC,)
    if out is None:
        out = torch.empty((T, Hv, V), dtype=v.dtype, device=v.device)
    if norm is not None:
        gated_delta_varlen_ref(q, k, v, a, b, A_log, dt_bias, state, query_start_loc, init_page, chunk_start,
                               chunk_seq, chunk_page, out=out)
        flat = out.view(T, Hv * V)
        flat.copy_(norm.apply(flat, ref=True))
        return out
    acc = torch.promote_types(v.dtype, torch.float32)
    dev = v.device
    if S == 0 or NC == 0:
        return out
    run = _gather_pages(state, init_page, acc)  # [S, Hv, K, V]; all read before any write
    qf, kf, g, beta = _prepare(q, k, a, b, A_log, dt_bias, Hv, acc, divide=False)
    vf = v.to(acc)

    for rnd in chunk_rounds(query_start_loc, chunk_start, chunk_seq, chunk_page, T):
        seq, L, valid, tok = rnd.seq, rnd.L, rnd.valid, rnd.tok
        vm = valid[..., None]

        def heads_first(x: torch.Tensor) -> torch.Tensor:  # [m, L, H, ...] -> [m, H, L, ...]
            return x.transpose(1, 2)
        qc = heads_first(qf[tok] * vm[..., None])
        kc = heads_first(kf[tok] * vm[..., None])
        vc = heads_first(vf[tok] * vm[..., None])
        bc = heads_first(beta[tok] * vm)  # [m, H, L]
        cum = heads_first(g[tok] * vm).cumsum(dim=-1)
        upper = torch.ones(L, L, dtype=torch.bool, device=dev).triu(1)
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
        k_beta = kc * bc[..., None]
        ut = (k_beta @ kc.transpose(-1, -2)) * decay
        new_values = torch.linalg.solve_triangular(ut, vc * bc[..., None], upper=False, unitriangular=True)
        k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False,
                                                   unitriangular=True)
        attn = (qc @ kc.transpose(-1, -2)) * decay
        h = run[seq]  # [m, Hv, K, V]
        v_new = new_values - k_cumdecay @ h
        o = (qc * cum.exp()[..., None]) @ h + attn @ v_new  # [m, H, L, V]
        h = h * cum[..., -1].exp()[..., None, None] + (kc * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2) @ v_new
        run[seq] = h
        out[tok[valid]] = o.transpose(1, 2)[valid].to(out.dtype)
        keep = rnd.pages > 0
        if keep.any():
            state[rnd.pages[keep]] = h[keep].to(state.dtype)
    return out
