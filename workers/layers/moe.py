"""Routed experts: a router that picks each token's top-k experts, and the experts' gated MLPs.

Tensor parallelism splits every expert's intermediate size across the ranks (each rank holds
[E, 2I/tp, H] of gate|up and [E, H, I/tp] of down for all E experts), so each rank computes a
partial sum for every token and one all-reduce, shared with whatever else the layer adds (a
shared MLP), finishes it; the router is replicated. That relies on every rank holding the same
hidden states bit for bit (NCCL's and the one-shot all-reduce's sums are the same on every
rank): ranks that disagreed on a top-k would sum different experts. Expert parallelism is not
built.
"""
from __future__ import annotations

import torch
from torch import nn

from kernels.fused_moe import tokens_per_tile_band
from workers.ops import act_and_mul, fused_experts_op, linear_op, topk_softmax_op
from workers.parallel import TPGroup, split_evenly


class Router(nn.Module):
    """The router's logits, x R^T (+ b) in x's dtype (replicated on every rank); the choice
    (`FusedMoE`) reads them in float32."""

    def __init__(self, hidden: int, num_experts: int, dtype: torch.dtype, device: torch.device,
                 bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_op(x, self.weight, self.bias)


class FusedMoE(nn.Module):
    """Experts' weights stacked as [E, 2I, H] (gate rows, then up rows) and [E, H, I], with
    optional biases [E, 2I] and [E, H]. `forward` takes the router's logits, keeps each token's
    `top_k` largest and weighs those experts by the softmax over the k (Granite's and gpt-oss's
    rule, not a softmax over all experts; the same as Qwen's softmax over all experts with the
    top k renormalised, `norm_topk_prob`), or with `renormalize` False by their softmax over all
    experts (Qwen3-Next without `norm_topk_prob`), and returns this rank's partial sum (all-reduce
    it): the down bias is added on rank 0 only, so that the sum holds it once. `activation` is a
    name (`workers.ops.act_and_mul`) or a function [R, 2I] -> [R, I].

    The weights load stacked (`weight_loader` with no shard: the whole [E, 2I, H] or [E, H, I]
    tensor) or one expert's tensor at a time (shard (expert, 0) its gate_proj [I, H], (expert, 1)
    its up_proj, (expert, None) its down_proj [H, I]), as checkpoints keep them either way."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, activation, tp: TPGroup,
                 dtype: torch.dtype, device: torch.device, name: str = "", bias: bool = False,
                 renormalize: bool = True) -> None:
        super().__init__()
        self.renormalize = renormalize
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"{name}: experts per token must be 1 to {num_experts} (the experts), got {top_k}")
        self.name, self.num_experts, self.top_k, self.hidden, self.intermediate = \
            name, num_experts, top_k, hidden, intermediate
        self.start, self.size = split_evenly(intermediate, tp, f"{name} expert intermediate size")
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.size, hidden, dtype=dtype, device=device),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.size, dtype=dtype, device=device),
                               requires_grad=False)
        self.b13 = self.b2 = None
        if bias:
            self.b13 = nn.Parameter(torch.empty(num_experts, 2 * self.size, dtype=dtype, device=device),
                                    requires_grad=False)
            self.b2 = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device), requires_grad=False)
        self.first_rank = tp.rank == 0
        self.act = act_and_mul(activation) if isinstance(activation, str) else activation

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        e, h, i = self.num_experts, self.hidden, self.intermediate
        shapes = {"w13": (e, 2 * i, h), "w2": (e, h, i)}
        if self.b13 is not None:
            shapes.update(b13=(e, 2 * i), b2=(e, h))
        return shapes

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: object = None) -> None:
        which = next(n for n in ("w13", "w2", "b13", "b2") if param is getattr(self, n))
        if shard is not None:
            self.load_expert(which, param, full, *shard)
            return
        want = self.full_shapes()[which]
        if tuple(full.shape) != want:
            raise ValueError(f"{self.name}.{which}: checkpoint tensor has shape {tuple(full.shape)}, expected {want}")
        if which == "b2":
            param.data.copy_(full)
        elif which == "w2":
            param.data.copy_(full.narrow(2, self.start, self.size))
        else:  # each half (gate, up) split on its own
            param.data[:, :self.size].copy_(full.narrow(1, self.start, self.size))
            param.data[:, self.size:].copy_(full.narrow(1, self.intermediate + self.start, self.size))

    def load_expert(self, which: str, param: nn.Parameter, full: torch.Tensor, expert: int, half: int | None) -> None:
        """One expert's gate_proj (half 0) or up_proj (half 1) into w13, or its down_proj into w2."""
        h, i = self.hidden, self.intermediate
        want = {"w13": (i, h), "w2": (h, i)}.get(which)
        if want is None or (which == "w13") != (half is not None) or not 0 <= expert < self.num_experts:
            raise ValueError(f"{self.name}: no per-expert tensor {which} half {half} of expert {expert}")
        if tuple(full.shape) != want:
            raise ValueError(f"{self.name}.{expert}: checkpoint tensor has shape {tuple(full.shape)}, expected {want}")
        if which == "w2":
            param.data[expert].copy_(full.narrow(1, self.start, self.size))
        else:
            param.data[expert, half * self.size:(half + 1) * self.size].copy_(full.narrow(0, self.start, self.size))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.renormalize:
            weights, ids = topk_softmax_op(router_logits, self.top_k, x.dtype)
        else:
            probs, ids = torch.softmax(router_logits.float(), dim=-1).topk(self.top_k, dim=-1)
            weights = probs.to(x.dtype)
        return fused_experts_op(x, self.w13, self.w2, weights, ids, self.act, self.b13,
                                self.b2 if self.first_rank else None)

    def compile_variants(self) -> None:
        """Run one batch in each tile band of the kernels (they pick their tiles by the rows
        each expert gets), so that no prefill compiles a kernel while serving."""
        for t in tokens_per_tile_band(self.num_experts, self.top_k):
            x = torch.zeros(t, self.hidden, dtype=self.w13.dtype, device=self.w13.device)
            self(x, torch.randn(t, self.num_experts, device=x.device).to(x.dtype))  # the router's dtype
