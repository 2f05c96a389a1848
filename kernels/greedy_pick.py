"""A greedy step's tokens picked and recorded in two launches.

A step whose rows all decode greedily, without logprobs, penalties, grammar masks or logit
adjustments, samples each row's argmax and records it in the persistent batch: the token becomes
the row's last token (the next decode's input) and the row's output count grows by one. Through
torch that is an argmax (a reduction over the vocabulary), the rows' cast to int64, and an index,
an add and three index writes, one launch each: about 35 us at the head of a Qwen3.6-35B-A3B
batch-1 step on one H200 (their shares of the step's span, as `launch.bench.profile_decode
--marginal` takes them), for a few KB of work; these two launches take about 6 (the step 2.395 ->
2.353 ms). Here the first launch splits each row's vocabulary into SPLITS ranges, one
program a range keeping its largest logit and its first position; the second, a program a row,
picks the largest of those (the first range among equal ones) and writes the token, the row's
last token and its count.

The token is torch's `argmax` over the logits as given (their own dtype, compared exactly in
fp32): the lowest index among equal maxima; a NaN counts as larger than any number, as in torch,
except that it ties with +inf (the first of the two wins here; torch picks the NaN).
`greedy_pick_ref` is the torch path, the engine's on CPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_attention import _num_sms
from kernels.pdl import pdl_args, pdl_wait

__all__ = ["greedy_pick", "greedy_pick_ref", "greedy_splits"]

BLOCK_V = 1024  # logits a program reads at a time: 8 a thread on 4 warps
MAX_SPLITS = 256


@triton.jit
def _range_max_kernel(logits_ptr, val_ptr, idx_ptr, V, stride_l, span, SPLITS: tl.constexpr,
                      BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """The largest logit of row program_id(0)'s range program_id(1) (`span` logits, whole
    tiles) and its first position."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    lo = s * span
    offs = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    at = tl.full([BLOCK_V], 2147483647, tl.int32)
    for start in range(lo, tl.minimum(lo + span, V), BLOCK_V):
        cols = start + offs
        x = tl.load(logits_ptr + r * stride_l + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN as the largest
        # Per lane: strictly larger only, so each lane keeps its first position of its maximum.
        take = x > best
        best = tl.where(take, x, best)
        at = tl.where(take, cols, at)
    m = tl.max(best, axis=0)
    i = tl.min(tl.where(best == m, at, 2147483647), axis=0)
    tl.store(val_ptr + r * SPLITS + s, m)
    tl.store(idx_ptr + r * SPLITS + s, i)


@triton.jit
def _pick_record_kernel(val_ptr, idx_ptr, rows_ptr, tokens_ptr, last_ptr, count_ptr, SPLITS: tl.constexpr,
                        PDL: tl.constexpr):
    """Row r's token: the first range's position among the ranges of the largest logit; then
    recorded at its batch row."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, SPLITS)
    vals = tl.load(val_ptr + r * SPLITS + s)
    idx = tl.load(idx_ptr + r * SPLITS + s)
    m = tl.max(vals, axis=0)
    # A range whose logits are all -inf, or which lies past the vocabulary, keeps INT_MAX: a row
    # of -inf alone names position 0, as torch's argmax does.
    tok = tl.min(tl.where(vals == m, idx, 2147483647), axis=0)
    tok = tl.where(tok == 2147483647, 0, tok).to(tl.int64)
    tl.store(tokens_ptr + r, tok)
    row = tl.load(rows_ptr + r).to(tl.int64)
    tl.store(last_ptr + row, tok.to(last_ptr.dtype.element_ty))
    tl.store(count_ptr + row, tl.load(count_ptr + row) + 1)


def greedy_splits(rows: int, vocab: int, num_sms: int) -> int:
    """Ranges a row's vocabulary is split into: enough programs for two a SM, each at least one
    tile (a power of two, at most MAX_SPLITS)."""
    want = min(max(1, triton.cdiv(2 * num_sms, max(rows, 1))), triton.cdiv(vocab, BLOCK_V), MAX_SPLITS)
    return triton.next_power_of_2(want)


def _check(logits: torch.Tensor, rows: torch.Tensor, last_token: torch.Tensor, counts: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [rows, vocab] with a vocabulary, got {tuple(logits.shape)}")
    if rows.dim() != 1 or rows.shape[0] != logits.shape[0]:
        raise ValueError(f"rows must be [{logits.shape[0]}] (a batch row per logits row), got {tuple(rows.shape)}")
    if rows.dtype not in (torch.int32, torch.int64) or counts.dtype != torch.int64 or \
            last_token.dtype != torch.int64:
        raise TypeError(f"rows must be int32 or int64, last_token and counts int64; got {rows.dtype}, "
                        f"{last_token.dtype}, {counts.dtype}")
    if last_token.dim() != 1 or counts.shape != last_token.shape:
        raise ValueError(f"last_token and counts must be one [R] each, got {tuple(last_token.shape)} and "
                         f"{tuple(counts.shape)}")


def greedy_pick(logits: torch.Tensor, rows: torch.Tensor, last_token: torch.Tensor,
                counts: torch.Tensor) -> torch.Tensor:
    """tokens[i] = argmax(logits[i]) (int64 [N]); then last_token[rows[i]] = tokens[i] and
    counts[rows[i]] += 1 (each batch row at most once). logits [N, V] in any float dtype with a
    unit last stride."""
    _check(logits, rows, last_token, counts)
    n, v = logits.shape
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return tokens
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    splits = greedy_splits(n, v, _num_sms(logits.device))
    span = triton.cdiv(triton.cdiv(v, splits), BLOCK_V) * BLOCK_V
    vals = torch.empty(n, splits, dtype=torch.float32, device=logits.device)
    idx = torch.empty(n, splits, dtype=torch.int32, device=logits.device)
    _range_max_kernel[(n, splits)](logits, vals, idx, v, logits.stride(0), span, SPLITS=splits, BLOCK_V=BLOCK_V,
                                   num_warps=4, **pdl_args(logits))
    _pick_record_kernel[(n,)](vals, idx, rows, tokens, last_token, counts, SPLITS=splits, num_warps=1,
                             **pdl_args(logits))
    return tokens


def greedy_pick_ref(logits: torch.Tensor, rows: torch.Tensor, last_token: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
    """`greedy_pick` through torch (the engine's path on CPU)."""
    _check(logits, rows, last_token, counts)
    tokens = logits.argmax(dim=-1)
    rows = rows.long()
    last_token[rows] = tokens
    counts[rows] += 1
    return tokens
