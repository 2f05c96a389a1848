"""Routed experts kept in FP8 on the device (Qwen's published FP8 checkpoints of Qwen3-Next,
Qwen3.5-MoE and Qwen3.6-MoE, and llm-compressor's): `FusedMoE`'s routing, tensor-parallel split,
shared-expert slots and partial sums, its w13 / w2 as the checkpoint stores them, float8_e4m3fn
with their float32 scales (`kernels.fused_moe.ExpertScales`).

The checkpoints keep one tensor per expert and projection (`experts.{e}.gate_proj.weight` with
`weight_scale_inv` [I / bn, H / bk] in 128 x 128 blocks, or compressed-tensors' `weight_scale`
per channel [I, 1] or per tensor); each is loaded into its expert's slot as the bf16 layer loads
it (gate rows, then up rows; a rank's share of the intermediate size), its scales with it. With
block scales a rank's share and the hidden size must be whole blocks (refused when the layer is
built otherwise); per-tensor scales become per-row ones. The shared expert (the stack's last
slots) must be stored as the routed experts are: one stack, one format.
"""
from __future__ import annotations

import torch
from torch import nn

from distengine.quantization import QuantizationConfig
from kernels.fp8 import FP8_DTYPE, FP8_MAX
from kernels.fused_moe import ExpertScales
from workers.layers.linear import Fp8Layout, linear_quantization
from workers.layers.moe import FusedMoE
from workers.ops import fused_experts_op

PARTS = ("gate", "up", "down")


def fp8_experts(quant: QuantizationConfig | None, name: str, gated: bool = True,
                shared: str | None = None) -> bool:
    """Whether the checkpoint stores the experts `name` (our path of the experts module, their
    tensors `{name}.{e}.{part}_proj`) in FP8: all their projections or none, and a shared expert
    (`shared`: its module path) the same way, else a ValueError naming the mismatch."""
    if quant is None:
        return False
    parts = PARTS if gated else PARTS[1:]
    modules = [f"{name}.0.{p}_proj" for p in parts] + ([f"{shared}.{p}_proj" for p in parts] if shared else [])
    quantized = {m: quant.quantizes(m) for m in modules}
    if any(quantized.values()) and not all(quantized.values()):
        raise ValueError(f"{name}: the quantization_config quantizes {[m for m, q in quantized.items() if q]} but "
                         f"not {[m for m, q in quantized.items() if not q]}; the routed and shared experts are one "
                         f"stack here, in one format")
    return all(quantized.values())


def experts_class(name: str, gated: bool = True, shared: str | None = None) -> tuple[type, dict]:
    """The experts' layer for a model being built (`fp8_experts` under the quantization linear
    layers take now) and the options it adds: `Fp8FusedMoE` and its quantization, or `FusedMoE`."""
    quant = linear_quantization()
    if fp8_experts(quant, name, gated, shared):
        return Fp8FusedMoE, {"quant": quant}
    return FusedMoE, {}


class Fp8FusedMoE(FusedMoE):
    """`FusedMoE` with w13 [slots, 2I/tp, H] and w2 [slots, H, I/tp] in float8_e4m3fn and their
    scales `w13_scale` / `w2_scale` (float32: blocks [slots, rows / bn, K / bk], else one per
    row), filled one expert's tensor at a time (shard (expert, half) as `FusedMoE`'s, the scale
    tensors with the same shards)."""

    def __init__(self, *args, quant: QuantizationConfig, **kwargs) -> None:
        self.layout = Fp8Layout.of(quant)
        self.block, self.scale_name = self.layout.block, self.layout.scale_name
        super().__init__(*args, **kwargs)
        if kwargs.get("bias"):
            raise ValueError(f"{self.name}: FP8 experts with biases are not supported")
        if self.block is not None:
            shared = (("shared expert's share", self.shared_size),) if self.shared_intermediate else ()
            for what, n in (("hidden size", self.hidden), ("share of the intermediate size", self.size), *shared):
                for b in self.block:
                    if n % b:
                        raise ValueError(f"{self.name}: FP8 experts in {self.block} scale blocks need a {what} in "
                                         f"whole blocks, got {n} (tensor-parallel size "
                                         f"{self.intermediate // self.size}); use a tensor-parallel size whose share "
                                         f"is whole blocks")

    def make_weights(self, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        h, rows, inter = self.hidden, self.halves * self.size, self.size
        self.w13 = nn.Parameter(torch.zeros(slots, rows, h, dtype=FP8_DTYPE, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(slots, h, inter, dtype=FP8_DTYPE, device=device), requires_grad=False)
        if self.block is not None:
            bn, bk = self.block
            shapes = {"w13_scale": (slots, rows // bn, h // bk), "w2_scale": (slots, h // bn, inter // bk)}
        else:
            shapes = {"w13_scale": (slots, rows), "w2_scale": (slots, h)}
        for name, shape in shapes.items():  # (the shared expert's padding: zero weights, unit scales)
            setattr(self, name, nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device),
                                             requires_grad=False))

    def scales(self) -> ExpertScales:
        return ExpertScales(self.w13_scale, self.w2_scale, self.block)

    def _scale_bytes(self) -> int:
        return sum(p[0].numel() * p.element_size() for p in (self.w13_scale, self.w2_scale)) * self.num_experts

    def routed_bytes(self) -> int:
        """This rank's bytes of the routed experts as stored: a byte a weight, and their scales."""
        return super().routed_bytes() + self._scale_bytes()

    def routed_elements(self) -> int:
        return self.routed_params() + sum(p[0].numel() for p in (self.w13_scale, self.w2_scale)) * self.num_experts

    def part_scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """The checkpoint scale tensor of one [rows, cols] projection."""
        return self.layout.checkpoint_shape(rows, cols)

    def with_scales(self, weights: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Checkpoint weights (`....weight`: [rows, cols]) and, beside each, its scale tensor."""
        return {**weights, **{f"{n[:-len('weight')]}{self.scale_name}": self.part_scale_shape(*shape)
                              for n, shape in weights.items()}}

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        """Our stacked parameters' full shapes (the checkpoint fills them one expert at a time)."""
        e, h, rows, inter = self.num_experts, self.hidden, self.halves * self.intermediate, self.intermediate
        return {**super().full_shapes(), "w13_scale": (e,) + self.part_scale_shape(rows, h),
                "w2_scale": (e,) + self.part_scale_shape(h, inter)}

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: object = None) -> None:
        if shard is None:
            raise ValueError(f"{self.name}: FP8 experts load one expert's tensor at a time (experts.{{e}}.gate_proj."
                             f"weight and its scale), not stacked")
        if param is self.w13_scale or param is self.w2_scale:
            self._load_scale("w13" if param is self.w13_scale else "w2", param, full, *shard)
            return
        super().weight_loader(param, full, shard)

    def _load_scale(self, which: str, param: nn.Parameter, full: torch.Tensor, expert, half: int | None) -> None:
        """One expert's (or the shared expert's) scale tensor into its slots: the rows of this
        rank's share (w13) or its columns (w2's blocks along K), per-tensor ones spread per row."""
        shared = expert == "shared"
        total = self.shared_intermediate if shared else self.intermediate
        start, size = (self.shared_start, self.shared_size) if shared else (self.start, self.size)
        h = self.hidden
        rows, cols = (total, h) if which == "w13" else (h, total)
        want = self.part_scale_shape(rows, cols)
        label = f"{self.name}.{'shared' if shared else expert}.{which}_scale"
        if tuple(full.shape) != want and not (want == () and full.numel() == 1):
            raise ValueError(f"{label}: checkpoint tensor has shape {tuple(full.shape)}, expected {want}")
        if which == "w13" and half not in range(self.halves) or which == "w2" and half is not None:
            raise ValueError(f"{label}: no such part (half {half})")
        if not shared and not 0 <= expert < self.num_experts:
            raise ValueError(f"{label}: no expert {expert}")
        slots = [expert] if not shared else [self.num_experts + j for j in range(self.shared_slots)]
        for j, slot in enumerate(slots):
            lo, n = start + j * self.size, min(self.size, size - j * self.size)  # this slot's share
            if self.block is None:
                per_row = full.reshape(-1).expand(rows) if full.numel() == 1 else full.reshape(-1)
                if which == "w13":
                    param.data[slot, half * self.size:half * self.size + n].copy_(per_row.narrow(0, lo, n))
                else:
                    param.data[slot].copy_(per_row)
                continue
            bn, bk = self.block
            if which == "w13":
                param.data[slot, half * self.size // bn:(half * self.size + n) // bn].copy_(
                    full.narrow(0, lo // bn, n // bn))
            else:
                param.data[slot, :, :n // bk].copy_(full.narrow(1, lo // bk, n // bk))

    def dummy_weights(self, generator: torch.Generator) -> None:
        """Scales that take the random FP8 values to about +-1e-3 (`--load-format dummy`)."""
        for p in (self.w13_scale, self.w2_scale):
            p.data.uniform_(0.5e-3 / FP8_MAX, 1.5e-3 / FP8_MAX, generator=generator)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_experts_op(x, self.w13, self.w2, weights, ids, self.act, self.b13,
                                self.b2 if self.first_rank else None, weight_input=self.weight_input,
                                scales=self.scales())
