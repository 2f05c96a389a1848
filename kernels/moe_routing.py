"""The router's choice in one launch: each token's k largest logits, their experts, and the
softmax over those k (Granite's and gpt-oss's rule) or over all experts (`renormalize` False:
Jamba's, Qwen3-Next's without norm_topk_prob), or each one's sigmoid (`topk_sigmoid`, Llama-4's
rule).

Why a kernel: in torch it is a float cast, a top-k (a sort and a gather), a softmax and a cast
back, five launches that wait for one another and cannot start early (no PDL); at batch 1 on an
H200 they took ~14 us a layer, 0.5 ms of a Granite-4.0-H-Tiny decode step's 3.2 ms of kernels
(`launch/bench/profile_decode.py`). One program per token holds its row of logits in registers and
picks the k largest one after another.

A shared expert (Qwen3-Next's and Qwen3.5's, gated by sigmoid(x w)) joins as `shared` more slots
of each token's choice: its gate's logit is the column after the experts', its parts the
experts E .. E + shared - 1 (`FusedMoE` keeps a shared expert wider than one routed expert as
several), each weighed by the sigmoid of that logit. So the experts' kernels compute it with the
routed ones, rather than three more GEMVs and four elementwise launches a layer. Llama-4's shared
expert has no gate (`topk_sigmoid`): its slots weigh 1 and the logits have no column for it.

DeepSeek-V3's rule (Nemotron-H's experts: `topk_sigmoid_grouped`), one launch too: sigmoid
scores, a per-expert correction bias added for the choice only, the experts in `n_group` groups
of which the `topk_group` with the largest sums of their two best biased scores are kept, the
top k of those; each weighed by its unbiased score, renormalised over the k and scaled. In torch
(`topk_sigmoid_grouped_ref`, the CPU path) that is about a dozen small launches a layer (sigmoid,
bias add, group top-2 sums, group top-k, masked fill, top-k, gather, renormalise, scale, cast,
the shared slots' cat), each waiting for the last. The program holds the row as n_group runs
of the group's size padded to a power of two (group-major, so a slot's order is its expert's):
the groups' sums are one reduction along the runs, and each of the k picks one (value, index)
reduction whose ties go to the lower index. A row of 128 to 512 experts (Nemotron-3-Nano's 128,
DeepSeek-V3's 256 in 8 groups) is a few registers a thread.

Order and ties: experts come largest first, as `torch.topk` returns them; among equal logits the
lower expert id first (torch leaves that order unspecified; the grouped rule's torch reference
ranks with stable sorts to keep it, groups likewise). Weights are computed in fp32 (the softmax's
exp(l_j - l_max) / sum over the k) and rounded once to the requested dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_args, pdl_wait

__all__ = ["check_groups", "topk_sigmoid", "topk_sigmoid_grouped", "topk_sigmoid_grouped_ref", "topk_sigmoid_ref",
           "topk_softmax", "topk_softmax_ref"]


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, n_experts, stride_t,
                         K: tl.constexpr, K_P2: tl.constexpr, SHARED: tl.constexpr, BLOCK_E: tl.constexpr,
                         SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_t + cols, mask=cols < n_experts, other=float("-inf")).to(tl.float32)
    slots = tl.arange(0, K_P2)
    vals = tl.zeros([K_P2], tl.float32)
    ids = tl.zeros([K_P2], tl.int64)
    row = x
    top = tl.zeros([], tl.float32)
    for j in tl.static_range(K):
        # One (value, index) reduction a pick, the lowest id among equal logits, where a max and
        # then a min over the ids equal to it were two (on one H200 the Qwen3.6-35B-A3B and
        # gpt-oss-120b batch-1 steps moved by 0.01-0.02 ms with this and one warp).
        m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        i = tl.minimum(i, n_experts - 1)  # (a row of NaNs must still name an expert that exists)
        if j == 0:
            top = m
        if SIGMOID:
            vals = tl.where(slots == j, tl.sigmoid(m), vals)
        else:
            vals = tl.where(slots == j, tl.exp(m - top), vals)
        ids = tl.where(slots == j, i.to(tl.int64), ids)
        x = tl.where(cols == i, float("-inf"), x)
    if SIGMOID:
        w = vals
    elif RENORMALIZE:
        w = vals / tl.sum(vals, axis=0)
    else:
        w = vals / tl.sum(tl.exp(row - top), axis=0)  # the softmax over all experts
    keep = slots < K
    tl.store(weights_ptr + t * (K + SHARED) + slots, w.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + t * (K + SHARED) + slots, ids, mask=keep)
    if SHARED > 0:
        if SIGMOID:  # no gate: the shared expert weighs 1
            gate = tl.full([], 1.0, tl.float32)
        else:
            gate = tl.sigmoid(tl.load(logits_ptr + t * stride_t + n_experts).to(tl.float32))
        for j in tl.static_range(SHARED):
            tl.store(weights_ptr + t * (K + SHARED) + K + j, gate.to(weights_ptr.dtype.element_ty))
            tl.store(ids_ptr + t * (K + SHARED) + K + j, (n_experts + j).to(tl.int64))


def _check(logits: torch.Tensor, k: int, shared: int, gated: bool = True) -> int:
    """The number of routed experts (the logits' columns less the shared expert's gate)."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], got {tuple(logits.shape)}")
    if shared < 0:
        raise ValueError(f"shared expert slots must be 0 or more, got {shared}")
    e = logits.shape[1] - (1 if shared and gated else 0)
    if not 1 <= k <= e:
        raise ValueError(f"experts per token must be 1 to {e} (the experts), got {k}")
    return e


def _warps(e: int) -> int:
    """One warp up to 1,024 experts: each pick's reduction then stays in shuffles, with no
    shared-memory round trip and barrier between warps."""
    return 1 if e <= 1024 else 8


def _topk(logits: torch.Tensor, k: int, dtype: torch.dtype, shared: int, sigmoid: bool, renormalize: bool = True):
    e = _check(logits, k, shared, gated=not sigmoid)
    t = logits.shape[0]
    weights = torch.empty((t, k + shared), dtype=dtype, device=logits.device)
    ids = torch.empty((t, k + shared), dtype=torch.int64, device=logits.device)
    if t > 0:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        _topk_softmax_kernel[(t,)](logits, weights, ids, e, logits.stride(0), K=k, K_P2=triton.next_power_of_2(k),
                                   SHARED=shared, BLOCK_E=triton.next_power_of_2(e), SIGMOID=sigmoid,
                                   RENORMALIZE=renormalize, num_warps=_warps(e), **pdl_args(logits))
    return weights, ids


def topk_softmax(logits: torch.Tensor, k: int, dtype: torch.dtype, shared: int = 0,
                 renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype), or [T, E + 1] with the shared expert's gate last when
    `shared` > 0 -> (weights [T, k + shared] in `dtype`, expert ids [T, k + shared] int64). With
    `renormalize` False each of the k keeps its softmax over all experts (Jamba's router,
    Qwen3-Next without norm_topk_prob)."""
    return _topk(logits, k, dtype, shared, sigmoid=False, renormalize=renormalize)


def topk_sigmoid(logits: torch.Tensor, k: int, dtype: torch.dtype, shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-4's choice: logits [T, E] -> each token's k largest, each weighed by its own
    sigmoid (no normalisation over the k), then `shared` slots of weight 1 (an ungated shared
    expert); (weights [T, k + shared] in `dtype`, expert ids [T, k + shared] int64)."""
    return _topk(logits, k, dtype, shared, sigmoid=True)


def topk_softmax_ref(logits: torch.Tensor, k: int, dtype: torch.dtype, shared: int = 0,
                     renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The same choice through torch: top-k of the fp32 logits, softmax over them in fp32 (or,
    with `renormalize` False, the softmax over all experts of the k chosen: Qwen3-Next without
    `norm_topk_prob`), then the shared expert's slots."""
    e = _check(logits, k, shared)
    routed = logits[:, :e].float()
    if renormalize:
        top, ids = routed.topk(k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    else:
        weights, ids = torch.softmax(routed, dim=-1).topk(k, dim=-1)
    if shared:
        gate = torch.sigmoid(logits[:, e:].float()).expand(-1, shared)
        weights = torch.cat([weights, gate], dim=1)
        ids = torch.cat([ids, torch.arange(e, e + shared, device=ids.device).expand(ids.shape[0], -1)], dim=1)
    return weights.to(dtype), ids


def topk_sigmoid_ref(logits: torch.Tensor, k: int, dtype: torch.dtype,
                     shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_sigmoid` through torch: top-k of the logits, the sigmoid of each in fp32, then the
    shared expert's slots of weight 1."""
    e = _check(logits, k, shared, gated=False)
    top, ids = logits.float().topk(k, dim=-1)
    weights = torch.sigmoid(top)
    if shared:
        weights = torch.cat([weights, weights.new_ones(weights.shape[0], shared)], dim=1)
        ids = torch.cat([ids, torch.arange(e, e + shared, device=ids.device).expand(ids.shape[0], -1)], dim=1)
    return weights.to(dtype), ids


def check_groups(e: int, k: int, n_group: int, topk_group: int) -> None:
    """Raise ValueError unless `topk_sigmoid_grouped` can choose k of e experts in these groups."""
    if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"expert groups: {e} experts in n_group={n_group} groups, topk_group={topk_group} "
                         f"(need n_group to divide the experts and 1 <= topk_group <= n_group)")
    if n_group > 1 and e // n_group < 2:
        raise ValueError(f"expert groups: a group's score sums its two best experts, {e // n_group} per group")
    if k > topk_group * (e // n_group):
        raise ValueError(f"experts per token ({k}) exceed the experts of the kept groups "
                         f"({topk_group} x {e // n_group})")


def _check_grouped(logits: torch.Tensor, correction_bias: torch.Tensor | None, k: int, n_group: int,
                   topk_group: int, shared: int) -> int:
    e = _check(logits, k, shared, gated=False)
    check_groups(e, k, n_group, topk_group)
    bias = correction_bias
    if bias is not None and (tuple(bias.shape) != (e,) or bias.device != logits.device):
        raise ValueError(f"correction bias must be [{e}] on {logits.device}, got {tuple(bias.shape)} on {bias.device}")
    return e


@triton.jit
def _topk_sigmoid_grouped_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_t, scale,
                                 K: tl.constexpr, K_P2: tl.constexpr, SHARED: tl.constexpr,
                                 N_GROUP: tl.constexpr, GROUP: tl.constexpr, N_GROUP_P2: tl.constexpr,
                                 GROUP_P2: tl.constexpr, TOPK_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                                 RENORMALIZE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    # The row as N_GROUP_P2 runs of GROUP_P2 slots, group-major: a slot's order is its expert's.
    pos = tl.arange(0, N_GROUP_P2 * GROUP_P2)
    group = pos // GROUP_P2
    expert = group * GROUP + pos % GROUP_P2
    valid = (pos % GROUP_P2 < GROUP) & (group < N_GROUP)
    row = logits_ptr + t * stride_t
    choice = tl.sigmoid(tl.load(row + expert, mask=valid, other=0.0).to(tl.float32))
    if HAS_BIAS:
        choice += tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if TOPK_GROUP < N_GROUP:
        runs = tl.reshape(choice, [N_GROUP_P2, GROUP_P2])
        best, first = tl.max(runs, axis=1, return_indices=True, return_indices_tie_break_left=True)
        second = tl.max(tl.where(tl.arange(0, GROUP_P2)[None, :] == first[:, None], float("-inf"), runs), axis=1)
        groups = tl.arange(0, N_GROUP_P2)
        sums = tl.where(groups < N_GROUP, best + second, float("-inf"))
        kept = pos < 0
        for _ in tl.static_range(TOPK_GROUP):
            _, g = tl.max(sums, axis=0, return_indices=True, return_indices_tie_break_left=True)
            kept = kept | (group == g)
            sums = tl.where(groups == g, float("-inf"), sums)
        choice = tl.where(kept, choice, float("-inf"))
    slots = tl.arange(0, K_P2)
    ids = tl.zeros([K_P2], tl.int32)
    for j in tl.static_range(K):
        _, p = tl.max(choice, axis=0, return_indices=True, return_indices_tie_break_left=True)
        # (a row of NaNs must still name an expert that exists)
        ids = tl.where(slots == j, tl.minimum((p // GROUP_P2) * GROUP + p % GROUP_P2, N_GROUP * GROUP - 1), ids)
        choice = tl.where(pos == p, float("-inf"), choice)
    keep = slots < K
    # The chosen logits again (the row is in L1): their unbiased scores, as the choice computed them.
    w = tl.sigmoid(tl.load(row + ids, mask=keep, other=0.0).to(tl.float32))
    w = tl.where(keep, w, 0.0)
    if RENORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    w = w * scale
    tl.store(weights_ptr + t * (K + SHARED) + slots, w.to(weights_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + t * (K + SHARED) + slots, ids.to(tl.int64), mask=keep)
    for j in tl.static_range(SHARED):
        tl.store(weights_ptr + t * (K + SHARED) + K + j, tl.full([], 1.0, weights_ptr.dtype.element_ty))
        tl.store(ids_ptr + t * (K + SHARED) + K + j, tl.full([], N_GROUP * GROUP + j, tl.int64))


def topk_sigmoid_grouped(logits: torch.Tensor, correction_bias: torch.Tensor | None, k: int, n_group: int,
                         topk_group: int, renormalize: bool, scale: float, dtype: torch.dtype,
                         shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's (and Nemotron-H's) choice, as transformers' NemotronHTopkRouter computes it,
    in one launch: s = sigmoid(logits) in fp32; the choice reads s + `correction_bias` (fp32 [E]):
    the `topk_group` of `n_group` groups (contiguous runs of E / n_group experts) whose two largest
    biased scores sum highest, then the k largest biased scores within them (largest first, the
    lower id first among equals, groups likewise); each chosen expert weighs its s, divided by
    (their sum + 1e-20) when `renormalize`, times `scale`, rounded once to `dtype`; then `shared`
    slots of weight 1 (an ungated shared expert). (weights [T, k + shared], ids [T, k + shared]
    int64.)"""
    e = _check_grouped(logits, correction_bias, k, n_group, topk_group, shared)
    t = logits.shape[0]
    weights = torch.empty((t, k + shared), dtype=dtype, device=logits.device)
    ids = torch.empty((t, k + shared), dtype=torch.int64, device=logits.device)
    if t > 0:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        groups = n_group if topk_group < n_group else 1  # keeping every group keeps every expert
        if correction_bias is not None:
            correction_bias = correction_bias.contiguous()
        block = triton.next_power_of_2(groups) * triton.next_power_of_2(e // groups)
        _topk_sigmoid_grouped_kernel[(t,)](
            logits, correction_bias if correction_bias is not None else logits, weights, ids, logits.stride(0),
            float(scale), K=k, K_P2=triton.next_power_of_2(k), SHARED=shared, N_GROUP=groups, GROUP=e // groups,
            N_GROUP_P2=triton.next_power_of_2(groups), GROUP_P2=triton.next_power_of_2(e // groups),
            TOPK_GROUP=min(topk_group, groups), HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize,
            num_warps=_warps(block), **pdl_args(logits))
    return weights, ids


def topk_sigmoid_grouped_ref(logits: torch.Tensor, correction_bias: torch.Tensor | None, k: int, n_group: int,
                             topk_group: int, renormalize: bool, scale: float, dtype: torch.dtype,
                             shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_sigmoid_grouped` through torch ops (the CPU path). Stable descending sorts rather
    than `topk` rank the groups and the experts, so that equal values keep the lower id first."""
    e = _check_grouped(logits, correction_bias, k, n_group, topk_group, shared)
    scores = torch.sigmoid(logits.float())
    choice = scores + correction_bias.float() if correction_bias is not None else scores
    if topk_group < n_group:
        grouped = choice.view(-1, n_group, e // n_group)
        best = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (values only: their order does not matter)
        kept = best.sort(dim=-1, descending=True, stable=True)[1][:, :topk_group]
        keep = torch.zeros_like(best).scatter_(1, kept, 1.0)
        choice = grouped.masked_fill(keep[:, :, None] == 0, float("-inf")).view(-1, e)
    ids = choice.sort(dim=-1, descending=True, stable=True)[1][:, :k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    weights = weights * scale
    if shared:
        weights = torch.cat([weights, weights.new_ones(weights.shape[0], shared)], dim=1)
        ids = torch.cat([ids, torch.arange(e, e + shared, device=ids.device).expand(ids.shape[0], -1)], dim=1)
    return weights.to(dtype), ids
