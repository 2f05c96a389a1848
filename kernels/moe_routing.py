"""The router's choice in one launch: each token's k largest logits, their experts, and the
softmax over those k (Granite's and gpt-oss's rule).

Why a kernel: in torch it is a float cast, a top-k (a sort and a gather), a softmax and a cast
back, five launches that wait for one another and cannot start early (no PDL); at batch 1 on an
H200 they took ~14 us a layer, 0.5 ms of a Granite-4.0-H-Tiny decode step's 3.2 ms of kernels
(`launch/bench/profile_decode.py`). One program per token holds its row of logits in registers and
picks the k largest one after another.

Order and ties: experts come largest first, as `torch.topk` returns them; among equal logits the
lower expert id first (torch leaves that order unspecified). Weights are computed in fp32,
exp(l_j - l_max) / sum over the k, and rounded once to the requested dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_args, pdl_wait

__all__ = ["topk_softmax", "topk_softmax_ref"]


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, n_experts, stride_t,
                         K: tl.constexpr, K_P2: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_t + cols, mask=cols < n_experts, other=float("-inf")).to(tl.float32)
    slots = tl.arange(0, K_P2)
    vals = tl.zeros([K_P2], tl.float32)
    ids = tl.zeros([K_P2], tl.int64)
    top = tl.max(x, axis=0)
    for j in tl.static_range(K):
        m = tl.max(x, axis=0)
        i = tl.min(tl.where(x == m, cols, BLOCK_E), axis=0)  # the lowest id among equal logits
        vals = tl.where(slots == j, tl.exp(m - top), vals)
        ids = tl.where(slots == j, i.to(tl.int64), ids)
        x = tl.where(cols == i, float("-inf"), x)
    w = vals / tl.sum(vals, axis=0)
    keep = slots < K
    tl.store(weights_ptr + t * K + slots, w.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + t * K + slots, ids, mask=keep)


def _check(logits: torch.Tensor, k: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], got {tuple(logits.shape)}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"experts per token must be 1 to {logits.shape[1]} (the experts), got {k}")


def topk_softmax(logits: torch.Tensor, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype) -> (weights [T, k] in `dtype`, expert ids [T, k] int64)."""
    _check(logits, k)
    t, e = logits.shape
    weights = torch.empty((t, k), dtype=dtype, device=logits.device)
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device)
    if t > 0:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        _topk_softmax_kernel[(t,)](logits, weights, ids, e, logits.stride(0), K=k, K_P2=triton.next_power_of_2(k),
                                   BLOCK_E=triton.next_power_of_2(e), num_warps=4 if e <= 1024 else 8,
                                   **pdl_args(logits))
    return weights, ids


def topk_softmax_ref(logits: torch.Tensor, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The same choice through torch: top-k of the fp32 logits, softmax over them in fp32."""
    _check(logits, k)
    top, ids = logits.float().topk(k, dim=-1)
    return torch.softmax(top, dim=-1).to(dtype), ids
