"""Routed experts: a router that picks each token's top-k experts, and the experts' gated MLPs.

Tensor parallelism splits every expert's intermediate size across the ranks (each rank holds
[E, 2I/tp, H] of gate|up and [E, H, I/tp] of down for all E experts), so each rank computes a
partial sum for every token and one all-reduce, shared with whatever else the layer adds (a
shared MLP), finishes it; the router is replicated. That relies on every rank holding the same
hidden states bit for bit (NCCL's and the one-shot all-reduce's sums are the same on every
rank): ranks that disagreed on a top-k would sum different experts. Expert parallelism is not
built.

A shared expert beside the routed ones (Qwen3-Next's and Qwen3.5's, scaled by sigmoid(x w) of
its own gate) is kept as more experts of the same stack: its intermediate size (this rank's
share) cut into pieces of one routed expert's, the last zero-padded (silu(0) * 0 adds nothing),
each piece chosen by every token with the gate's weight (`kernels/moe_routing.py`). One grouped
GEMM pair then computes both, where a separate MLP cost three GEMVs and four elementwise
launches a layer (a batch-1 decode step of Qwen3.6-35B-A3B is bound by its launches). Llama-4's
shared expert, which has no gate, is kept the same way with weight 1 (`scoring` "sigmoid").

Nemotron-H's experts have no gate (`gated` False): up_proj alone, [E, I/tp, H] a rank, and an
elementwise activation (relu^2); its router is DeepSeek-V3's (`scoring` "sigmoid_grouped":
sigmoid scores, a correction bias for the choice alone, groups of experts, the weights
renormalised and scaled, one launch: `kernels/moe_routing.py`), its shared expert ungated too.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from kernels.fused_moe import compile_align_variants, moe_config, tokens_per_tile_band
from kernels.moe_routing import check_groups
from workers.ops import (act_and_mul, fused_experts_op, linear_op, topk_sigmoid_grouped_op, topk_sigmoid_op,
                         topk_softmax_op, ungated_act)
from workers.parallel import TPGroup, split_evenly


# The scale tensors beside an FP8 weight, by format (`distengine.quantization`'s scale names).
SCALE_SUFFIX = "_scale_inv|_scale"


@dataclass(frozen=True)
class ExpertWeightNames:
    """A routed-expert block's checkpoint tensors in their two layouts, mapped to FusedMoE's
    stacked `w13` / `w2`: one tensor per expert and projection (`{block}.{e}.gate_proj.weight`, as
    checkpoints are published) or stacked (`{block}.gate_up_proj`, as transformers 5 holds them).
    `block`: a regex of the experts module's path; `gated`: gate and up projections (w13 = [gate;
    up]), else up only (ungated experts)."""
    block: str
    gated: bool = True

    @cached_property
    def _parts(self) -> dict[str, tuple[str, int | None]]:  # a part: our tensor, and the half it fills
        gate_up = {"gate": ("w13", 0), "up": ("w13", 1)} if self.gated else {"up": ("w13", 0)}
        return {**gate_up, "down": ("w2", None)}

    @cached_property
    def _per_expert(self) -> re.Pattern:
        return re.compile(rf"^(.*\.{self.block})\.(\d+)\.({'|'.join(self._parts)})_proj\.weight({SCALE_SUFFIX})?$")

    @cached_property
    def _stacked(self) -> re.Pattern:
        return re.compile(rf"^(.*\.{self.block})\.({'gate_up' if self.gated else 'up'}|down)_proj$")

    def param(self, name: str) -> tuple[str, object] | None:
        """(our parameter, its loader's shard: (expert, half) one expert at a time, None stacked),
        or None for a tensor of no expert. An FP8 expert's scale tensor (`weight_scale_inv` or
        `weight_scale` beside its weight) fills `w13_scale` / `w2_scale` (`Fp8FusedMoE`)."""
        m = self._per_expert.match(name)
        if m:
            ours, half = self._parts[m[3]]
            return f"{m[1]}.{ours}{'_scale' if m[4] else ''}", (int(m[2]), half)
        m = self._stacked.match(name)
        if m:
            return f"{m[1]}.{'w2' if m[2] == 'down' else 'w13'}", None
        return None


class Router(nn.Module):
    """The router's logits, x R^T (+ b) in x's dtype (replicated on every rank); the choice
    (`FusedMoE`) reads them in float32. With `shared_gate` the shared expert's gate [1, hidden]
    is one more row (the weight loader's shard "shared"), its logit the last column. With
    `correction_bias` it keeps DeepSeek-V3's `e_score_correction_bias` [E] in float32 (added to
    the scores for the choice alone: `FusedMoE`'s "sigmoid_grouped")."""

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype, device: torch.device,
                 bias: bool = False, shared_gate: bool = False, name: str = "", correction_bias: bool = False) -> None:
        super().__init__()
        if bias and shared_gate:
            raise ValueError(f"{name}: a router with a bias and a shared expert's gate is not supported")
        self.name, self.num_experts, self.hidden = name, num_experts, hidden
        self.rows = num_experts + (1 if shared_gate else 0)
        # Rows padded with zeros to a multiple of 8, sliced off the logits: cuBLAS takes its fast
        # kernels only for outputs whose rows start 16-byte aligned. Qwen3.6-35B-A3B's 257 rows
        # (256 experts and the shared gate) at 8,192 tokens ran an sm75 `align1` kernel, 164 us a
        # layer, ~5% of the prefill step (one H200).
        padded = -(-self.rows // 8) * 8
        self.weight = nn.Parameter(torch.zeros(padded, hidden, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(padded, dtype=dtype, device=device), requires_grad=False) \
            if bias else None
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(num_experts, dtype=torch.float32, device=device), requires_grad=False) \
            if correction_bias else None

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {"weight": (self.num_experts, self.hidden)}
        if self.bias is not None:
            shapes["bias"] = (self.num_experts,)
        if self.e_score_correction_bias is not None:
            shapes["e_score_correction_bias"] = (self.num_experts,)
        return shapes

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: str | None = None) -> None:
        if shard == "shared" and param is self.weight and self.rows > self.num_experts:
            want, rows = (1, self.hidden), param.data[self.num_experts:self.rows]
        elif shard is None:
            want = self.full_shapes()["weight" if param is self.weight else
                                      "bias" if param is self.bias else "e_score_correction_bias"]
            rows = param.data[:self.num_experts]
        else:
            raise ValueError(f"{self.name}: no router part {shard!r}")
        if tuple(full.shape) != want:
            raise ValueError(f"{self.name}: checkpoint tensor has shape {tuple(full.shape)}, expected {want}")
        rows.copy_(full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear_op(x, self.weight, self.bias)
        return y if y.shape[-1] == self.rows else y[..., :self.rows]


class FusedMoE(nn.Module):
    """Experts' weights stacked as [E, 2I, H] (gate rows, then up rows) and [E, H, I], with
    optional biases [E, 2I] and [E, H]. `forward` takes the router's logits, keeps each token's
    `top_k` largest and weighs those experts by the softmax over the k (Granite's and gpt-oss's
    rule, not a softmax over all experts; the same as Qwen's softmax over all experts with the
    top k renormalised, `norm_topk_prob`), or with `renormalize` False by their softmax over all
    experts (Jamba; Qwen3-Next without `norm_topk_prob`), both in one launch, and returns this
    rank's partial sum (all-reduce it): the down bias is added on rank 0 only, so that the sum
    holds it once. `activation` is a
    name (`workers.ops.act_and_mul`) or a function [R, 2I] -> [R, I].

    The weights load stacked (`weight_loader` with no shard: the whole [E, 2I, H] or [E, H, I]
    tensor) or one expert's tensor at a time (shard (expert, 0) its gate_proj [I, H], (expert, 1)
    its up_proj, (expert, None) its down_proj [H, I]), as checkpoints keep them either way. With
    `shared_intermediate` > 0 a shared expert of that size follows the E routed ones (see the
    module's note; its router needs `shared_gate`): shard ("shared", 0 / 1 / None) loads its
    gate_proj, up_proj or down_proj.

    Llama-4's rule, `scoring` "sigmoid": each of the top k experts weighs the sigmoid of its own
    logit (no softmax), a shared expert weighs 1 (its router has no gate row), and with
    `weight_input` the weight scales the token's hidden state before the expert rather than the
    expert's output (`kernels.fused_moe`).

    DeepSeek-V3's rule, `scoring` "sigmoid_grouped" (Nemotron-H): `forward` takes the router's
    correction bias too; `groups` (n_group, topk_group) and `scale` (routed_scaling_factor) as
    `kernels.moe_routing.topk_sigmoid_grouped`, `renormalize` its norm_topk_prob; a shared expert
    weighs 1. `gated` False: experts without a gate, w13 [E, I, H] of up rows (shard (expert, 0)
    or ("shared", 0) loads an up_proj) and `activation` an elementwise one (`workers.ops.ungated_act`)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, activation, tp: TPGroup,
                 dtype: torch.dtype, device: torch.device, name: str = "", bias: bool = False,
                 renormalize: bool = True, shared_intermediate: int = 0, scoring: str = "softmax",
                 weight_input: bool = False, gated: bool = True, groups: tuple[int, int] = (1, 1),
                 scale: float = 1.0) -> None:
        super().__init__()
        if scoring not in ("softmax", "sigmoid", "sigmoid_grouped"):
            raise ValueError(f"{name}: router scoring {scoring!r} is not supported (softmax, sigmoid or "
                             f"sigmoid_grouped)")
        self.gated, self.groups, self.scale = gated, groups, float(scale)
        self.halves = 2 if gated else 1
        if weight_input and bias:
            raise ValueError(f"{name}: router weights on the experts' input need experts without biases")
        self.renormalize, self.scoring, self.weight_input = renormalize, scoring, weight_input
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{name}: experts per token must be 1 to {num_experts} (the experts), got {top_k}")
        self.name, self.num_experts, self.top_k, self.hidden, self.intermediate = \
            name, num_experts, top_k, hidden, intermediate
        if scoring == "sigmoid_grouped":
            try:
                check_groups(num_experts, top_k, *groups)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        self.start, self.size = split_evenly(intermediate, tp, f"{name} expert intermediate size")
        self.shared_intermediate, self.shared_slots = shared_intermediate, 0
        if shared_intermediate:
            if bias:
                raise ValueError(f"{name}: experts with biases and a shared expert are not supported")
            self.shared_start, self.shared_size = split_evenly(shared_intermediate, tp,
                                                               f"{name} shared expert intermediate size")
            self.shared_slots = -(-self.shared_size // self.size)
        self.dtype, self.device = dtype, device
        self.make_weights(num_experts + self.shared_slots, dtype, device)
        self.b13 = self.b2 = None
        if bias:
            self.b13 = nn.Parameter(torch.empty(num_experts, self.halves * self.size, dtype=dtype, device=device),
                                    requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device), requires_grad=False)
        self.first_rank = tp.rank == 0
        if isinstance(activation, str):
            activation = act_and_mul(activation) if gated else ungated_act(activation)
        self.act = activation

    def make_weights(self, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        """w13 and w2 for `slots` experts (a subclass keeps them in another format)."""
        self.w13 = nn.Parameter(torch.empty(slots, self.halves * self.size, self.hidden, dtype=dtype, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(slots, self.hidden, self.size, dtype=dtype, device=device),
                               requires_grad=False)
        self.w13.data[self.num_experts:].zero_()  # the shared expert's padding
        self.w2.data[self.num_experts:].zero_()

    def routed_bytes(self) -> int:
        """This rank's bytes of the routed experts (a step reads those its tokens chose; a shared
        expert's slots it reads whole)."""
        slot = sum(p[0].numel() * p.element_size() for p in (self.w13, self.w2))
        return slot * self.num_experts + sum(p.numel() * p.element_size() for p in (self.b13, self.b2)
                                             if p is not None)

    def routed_params(self) -> int:
        """This rank's weights of the routed experts (elements, not bytes)."""
        return sum(p[0].numel() for p in (self.w13, self.w2)) * self.num_experts + \
            sum(p.numel() for p in (self.b13, self.b2) if p is not None)

    def routed_elements(self) -> int:
        """Elements of the tensors that store this rank's routed experts (one a weight here)."""
        return self.routed_params()

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        e, h, i = self.num_experts, self.hidden, self.intermediate
        shapes = {"w13": (e, self.halves * i, h), "w2": (e, h, i)}
        if self.b13 is not None:
            shapes.update(b13=(e, self.halves * i), b2=(e, h))
        return shapes

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: object = None) -> None:
        which = next(n for n in ("w13", "w2", "b13", "b2") if param is getattr(self, n))
        if shard is not None and shard[0] == "shared":
            self.load_shared(which, param, full, shard[1])
            return
        if shard is not None:
            self.load_expert(which, param, full, *shard)
            return
        want = self.full_shapes()[which]
        if tuple(full.shape) != want:
            raise ValueError(f"{self.name}.{which}: checkpoint tensor has shape {tuple(full.shape)}, expected {want}")
        dst = param.data[:self.num_experts]  # (a shared expert's slots follow)
        if which == "b2":
            dst.copy_(full)
        elif which == "w2":
            dst.copy_(full.narrow(2, self.start, self.size))
        else:  # each half (gate, up) split on its own
            for half in range(self.halves):
                dst[:, half * self.size:(half + 1) * self.size].copy_(
                    full.narrow(1, half * self.intermediate + self.start, self.size))

    def load_expert(self, which: str, param: nn.Parameter, full: torch.Tensor, expert: int, half: int | None) -> None:
        """One expert's gate_proj (half 0) or up_proj (half 1; half 0 without a gate) into w13, or
        its down_proj into w2."""
        h, i = self.hidden, self.intermediate
        want = {"w13": (i, h), "w2": (h, i)}.get(which)
        if want is None or (which == "w13") != (half in range(self.halves)) or not 0 <= expert < self.num_experts:
            raise ValueError(f"{self.name}: no per-expert tensor {which} half {half} of expert {expert}")
        if tuple(full.shape) != want:
            raise ValueError(f"{self.name}.{expert}: checkpoint tensor has shape {tuple(full.shape)}, expected {want}")
        if which == "w2":
            param.data[expert].copy_(full.narrow(1, self.start, self.size))
        else:
            param.data[expert, half * self.size:(half + 1) * self.size].copy_(full.narrow(0, self.start, self.size))

    def load_shared(self, which: str, param: nn.Parameter, full: torch.Tensor, half: int | None) -> None:
        """The shared expert's gate_proj (half 0) or up_proj (half 1) [S, H], or its down_proj
        [H, S]: this rank's S / tp columns into the slots after the routed experts."""
        h, s = self.hidden, self.shared_intermediate
        want = {"w13": (s, h), "w2": (h, s)}.get(which)
        if not s or want is None or (which == "w13") != (half in range(self.halves)):
            raise ValueError(f"{self.name}: no shared expert tensor {which} half {half}")
        if tuple(full.shape) != want:
            raise ValueError(f"{self.name} (shared expert): checkpoint tensor has shape {tuple(full.shape)}, "
                             f"expected {want}")
        mine = full.narrow(0 if which == "w13" else 1, self.shared_start, self.shared_size)
        for j in range(self.shared_slots):
            cols = min(self.size, self.shared_size - j * self.size)
            slot = self.num_experts + j
            if which == "w2":
                param.data[slot, :, :cols].copy_(mine.narrow(1, j * self.size, cols))
            else:
                param.data[slot, half * self.size:half * self.size + cols].copy_(mine.narrow(0, j * self.size, cols))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.scoring == "sigmoid_grouped":
            weights, ids = topk_sigmoid_grouped_op(router_logits, correction_bias, self.top_k, *self.groups,
                                                   self.renormalize, self.scale, x.dtype, self.shared_slots)
        elif self.scoring == "sigmoid":
            weights, ids = topk_sigmoid_op(router_logits, self.top_k, x.dtype, self.shared_slots)
        else:
            weights, ids = topk_softmax_op(router_logits, self.top_k, x.dtype, self.shared_slots,
                                           renormalize=self.renormalize)
        return self.run_experts(x, weights, ids)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over each token's chosen experts."""
        return fused_experts_op(x, self.w13, self.w2, weights, ids, self.act, self.b13,
                                self.b2 if self.first_rank else None, weight_input=self.weight_input)

    def compile_variants(self) -> None:
        """Run one batch in each tile band of the kernels (they pick their tiles by the rows
        each expert gets), so that no prefill compiles a kernel while serving."""
        for t in self.variant_tokens():
            x = torch.zeros(t, self.hidden, dtype=self.dtype, device=self.device)
            gate = 1 if self.shared_slots and self.scoring == "softmax" else 0  # the shared expert's gate
            logits = torch.randn(t, self.num_experts + gate, device=x.device)
            if self.scoring == "sigmoid_grouped":  # (an fp32 router, and its correction bias)
                self(x, logits, torch.zeros(self.num_experts, device=x.device))
            else:
                self(x, logits.to(x.dtype))  # the router's dtype
        compile_align_variants(self.num_experts + self.shared_slots, self.top_k + self.shared_slots,
                               self.dtype.itemsize, x.device, self.block_m_of)

    def variant_tokens(self) -> list[int]:
        """A batch size in each of the kernels' tile bands."""
        return tokens_per_tile_band(self.num_experts, self.top_k)

    def block_m_of(self, num_pairs: int) -> int:
        """The row tile the kernels use for a batch of `num_pairs` (token, expert) pairs."""
        return moe_config(num_pairs, self.num_experts + self.shared_slots, self.dtype.itemsize)["BLOCK_M"]
