"""Routed experts kept in MXFP4 on the device (gpt-oss's published checkpoints): `FusedMoE`'s
routing, tensor-parallel split and partial sums, its weights as the checkpoint stores them.

The checkpoint holds `gate_up_proj_blocks` [E, 2I, H/32, 16] and `down_proj_blocks` [E, H, I/32, 16]
(uint8, two e2m1 values a byte) with `*_scales` [E, 2I, H/32] and [E, H, I/32] (E8M0), each the
weight [rows, K] of `kernels.fused_moe_mxfp4`, the gate and up rows interleaved (row 2j the gate
of column j, 2j + 1 its up; `gate_up_proj_bias` likewise): kept so, the kernel's first launch
applies the activation to whole (gate, up) pairs. A rank keeps [E, 2I/tp, H/2] and
[E, H, I/(2 tp)] bytes with their scales: its 2I/tp consecutive gate/up rows (the pairs of its
columns), the down weights split along K, so I/tp must be whole 32-element scale blocks (refused
otherwise, before any weight is read).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from kernels.fused_moe_mxfp4 import MXFP4_BLOCK, MXFP4Weight, SwigluOAI, mxfp4_config, mxfp4_variant_tokens
from workers.layers.moe import FusedMoE
from workers.ops import fused_experts_mxfp4_op
from workers.parallel import TPGroup

WEIGHTS = ("w13_blocks", "w13_scales", "w2_blocks", "w2_scales")
# Random weights' scales (`dummy_weights`): 2^-3 .. 2^0, so that values stay finite and small.
DUMMY_SCALES = (124, 128)


class MXFP4FusedMoE(FusedMoE):
    """`FusedMoE` (softmax over the top k, gpt-oss's activation `SwigluOAI`, optional biases in
    the model's dtype) with w13 and w2 in MXFP4: parameters `w13_blocks`, `w13_scales`, `w2_blocks`,
    `w2_scales`, loaded stacked in the checkpoint's shapes and row order (no per-expert tensors,
    no shared expert)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int, activation: SwigluOAI,
                 tp: TPGroup, dtype: torch.dtype, device: torch.device, name: str = "", bias: bool = False) -> None:
        if not isinstance(activation, SwigluOAI):
            raise TypeError(f"{name}: MXFP4 experts run gpt-oss's activation (a SwigluOAI), got {activation!r}")
        if hidden % MXFP4_BLOCK or intermediate % MXFP4_BLOCK:
            raise ValueError(f"{name}: MXFP4 experts need hidden ({hidden}) and intermediate ({intermediate}) sizes "
                             f"in whole {MXFP4_BLOCK}-element scale blocks")
        share = intermediate // tp.world_size
        if intermediate % tp.world_size == 0 and share % MXFP4_BLOCK:
            raise ValueError(f"{name}: MXFP4 experts over tensor-parallel size {tp.world_size} would give each rank "
                             f"{share} of the intermediate size {intermediate}, not whole {MXFP4_BLOCK}-element "
                             f"scale blocks: use a tensor-parallel size that divides {intermediate // MXFP4_BLOCK}")
        super().__init__(num_experts, top_k, hidden, intermediate, activation, tp, dtype, device, name, bias=bias)

    def make_weights(self, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        e, h, rows, inter = slots, self.hidden, self.halves * self.size, self.size
        shapes = {"w13_blocks": (e, rows, h // 2), "w13_scales": (e, rows, h // MXFP4_BLOCK),
                  "w2_blocks": (e, h, inter // 2), "w2_scales": (e, h, inter // MXFP4_BLOCK)}
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=torch.uint8, device=device),
                                             requires_grad=False))

    def weights(self) -> tuple[MXFP4Weight, MXFP4Weight]:
        return MXFP4Weight(self.w13_blocks, self.w13_scales), MXFP4Weight(self.w2_blocks, self.w2_scales)

    def routed_bytes(self) -> int:
        """This rank's bytes of the experts as stored: 4.25 bits a weight, and the biases."""
        return sum(p.numel() * p.element_size() for p in (*(getattr(self, n) for n in WEIGHTS), self.b13, self.b2)
                   if p is not None)

    def routed_params(self) -> int:
        """This rank's weights of the experts (elements, not bytes)."""
        w13, w2 = self.weights()
        return sum(math.prod(w.shape) for w in (w13, w2)) + sum(p.numel() for p in (self.b13, self.b2)
                                                                 if p is not None)

    def routed_elements(self) -> int:
        """Elements of the tensors that store the experts: bytes of blocks and scales, the biases."""
        return sum(p.numel() for p in (*(getattr(self, n) for n in WEIGHTS), self.b13, self.b2) if p is not None)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        e, h, i, g = self.num_experts, self.hidden, self.intermediate, MXFP4_BLOCK
        rows = self.halves * i
        shapes = {"w13_blocks": (e, rows, h // g, g // 2), "w13_scales": (e, rows, h // g),
                  "w2_blocks": (e, h, i // g, g // 2), "w2_scales": (e, h, i // g)}
        if self.b13 is not None:
            shapes.update(b13=(e, rows), b2=(e, h))
        return shapes

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: object = None) -> None:
        which = next(n for n in (*WEIGHTS, "b13", "b2") if param is getattr(self, n))
        if shard is not None:
            raise ValueError(f"{self.name}: MXFP4 experts load stacked (gate_up_proj_blocks, ...), not one expert's "
                             f"tensor at a time")
        want = self.full_shapes()[which]
        if tuple(full.shape) != want:
            raise ValueError(f"{self.name}.{which}: checkpoint tensor has shape {tuple(full.shape)}, expected {want}")
        if which == "b2":
            param.data.copy_(full)
        elif which.startswith("w2"):  # split along K: whole scale blocks
            mine = full.narrow(2, self.start // MXFP4_BLOCK, self.size // MXFP4_BLOCK)
            param.data.copy_(mine.reshape(param.shape))
        else:  # w13 and b13: this rank's (gate, up) row pairs, consecutive
            param.data.copy_(full.narrow(1, 2 * self.start, 2 * self.size).reshape(param.shape))

    def dummy_weights(self, generator: torch.Generator) -> None:
        """Random bytes and scales near 2^0 (`--load-format dummy`): every e2m1 value occurs."""
        for name in WEIGHTS:
            p = getattr(self, name)
            low, high = (0, 256) if name.endswith("blocks") else DUMMY_SCALES
            p.data.random_(low, high, generator=generator)  # (in place: no second copy of ~1 GB a layer)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.weights()
        return fused_experts_mxfp4_op(x, w13, w2, weights, ids, self.act, self.b13,
                                      self.b2 if self.first_rank else None)

    def variant_tokens(self) -> list[int]:
        """The grouped GEMMs' bands and the few-token paths' variants (GEMVs, tile GEMVs)."""
        few = mxfp4_variant_tokens(self.num_experts, self.top_k, self.dtype.itemsize)
        return sorted(set(super().variant_tokens()) | set(few))

    def block_m_of(self, num_pairs: int) -> int:
        return mxfp4_config(num_pairs, self.num_experts, self.dtype.itemsize)["BLOCK_M"]

