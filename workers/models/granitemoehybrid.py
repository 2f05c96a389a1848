"""Granite-4.0-H (GraniteMoeHybrid): Mamba-2 or attention layers (`layer_types`), each followed
by the `shared_mlp` and, with routed experts (`num_local_experts` > 0: Tiny, Small), the
`block_sparse_moe` beside it; Granite's multipliers:

* `embedding_multiplier` on the embedding; `residual_multiplier` on both sublayers' outputs before
  they join the residual stream; `attention_multiplier` is the attention scale (not
  head_dim ** -0.5); the logits divided by `logits_scaling`;
* RoPE only when `position_embedding_type` is "rope" (the released models: "nope");
* the shared MLP: one fused `input_linear` [gate | up] (halves of 2 * shared_intermediate_size)
  and `output_linear`, silu-gated; `input_linear` is sliced per half for tensor parallelism;
* Mamba-2 mixers as Bamba's: gated RMSNorm with the gate before the norm;
* the routed experts: a router (top-k of its logits, softmax over those k), then the experts'
  silu-gated MLPs (`workers/layers/moe.py`); their sum and the shared MLP's leave the layer
  through one all-reduce. Checkpoints name them `block_sparse_moe.input_linear` [E, 2I, H],
  `output_linear` [E, H, I] and `router.layer` (transformers 5 in memory: `experts.gate_up_proj`,
  `experts.down_proj`, `router.weight`); both spellings load.
"""
from __future__ import annotations

import torch
from torch import nn

from workers.layers.linear import RowParallelLinear
from workers.layers.mamba import Segmented
from workers.layers.moe import FusedMoE, Router
from workers.models.hybrid import HybridDecoderLayer, HybridForCausalLM, multiplier
from workers.models.llama import LlamaAttention
from workers.ops import act_and_mul
from workers.parallel import TPGroup, split_evenly


class GraniteMoeHybridAttention(LlamaAttention):
    def scale(self, config) -> float:
        return multiplier(config, "attention_multiplier")


class GraniteSharedMLP(nn.Module):
    """input_linear [gate | up] (each half column-parallel on its own) -> silu(gate) * up ->
    output_linear (row-parallel)."""

    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str, reduce: bool = True) -> None:
        super().__init__()
        h, i = config.hidden_size, config.shared_intermediate_size
        start, size = split_evenly(i, tp, f"{prefix}.input_linear half")
        self.input_linear = Segmented([(i, start, size), (i, start, size)], (h,), False, dtype, device,
                                      f"{prefix}.input_linear", linear=True, tp_size=tp.world_size)
        self.output_linear = RowParallelLinear(i, h, False, tp, dtype, device, f"{prefix}.output_linear",
                                               reduce=reduce)
        self.act = act_and_mul(getattr(config, "hidden_act", None) or "silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(self.act(self.input_linear.matmul(x)))


class GraniteMoE(nn.Module):
    """block_sparse_moe: the router and the routed experts (this rank's partial sum)."""

    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str) -> None:
        super().__init__()
        e, h = num_experts(config), config.hidden_size
        self.router = Router(h, e, dtype, device)
        self.experts = FusedMoE(e, int(config.num_experts_per_tok), h, config.intermediate_size,
                                getattr(config, "hidden_act", None) or "silu", tp, dtype, device, f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GraniteMoeHybridDecoderLayer(HybridDecoderLayer):
    """Pre-norm Mamba-2 or attention, then the pre-norm shared MLP (with the routed experts beside
    it, their sums added before one all-reduce); each output scaled by the residual multiplier
    before the (fused) residual add."""

    ff_norm_name = "post_attention_layernorm"
    attention_cls = GraniteMoeHybridAttention

    def build_feed_forward(self, config, tp, dtype, device, prefix: str) -> None:
        # With experts, both sums leave through one all-reduce (the layer's), not one each.
        self.block_sparse_moe = GraniteMoE(config, tp, dtype, device, f"{prefix}.block_sparse_moe") \
            if num_experts(config) > 0 else None
        self.shared_mlp = GraniteSharedMLP(config, tp, dtype, device, f"{prefix}.shared_mlp",
                                           reduce=self.block_sparse_moe is None)

    def run_feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.block_sparse_moe is None:
            return self.shared_mlp(h)
        return self.tp.all_reduce(self.block_sparse_moe(h) + self.shared_mlp(h))


def num_experts(config) -> int:
    return int(getattr(config, "num_local_experts", 0) or 0)


# Our parameter (suffix) -> its checkpoint spellings: the published one, then transformers 5's.
_MOE = ".block_sparse_moe."
EXPERT_NAMES = {
    f"{_MOE}experts.w13": (f"{_MOE}input_linear.weight", f"{_MOE}experts.gate_up_proj"),
    f"{_MOE}experts.w2": (f"{_MOE}output_linear.weight", f"{_MOE}experts.down_proj"),
    f"{_MOE}router.weight": (f"{_MOE}router.layer.weight", f"{_MOE}router.weight"),
}


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    decoder_layer_cls = GraniteMoeHybridDecoderLayer

    def rope_caches(self, config, kinds, device):
        if getattr(config, "position_embedding_type", None) != "rope":
            return [None] * len(kinds)  # NoPE
        return super().rope_caches(config, kinds, device)

    # ---- weights: the experts under their published checkpoint names or transformers 5's -----
    def our_name(self, checkpoint_name: str) -> str:
        for ours, spellings in EXPERT_NAMES.items():
            for s in spellings:
                if checkpoint_name.endswith(s):
                    return checkpoint_name[: -len(s)] + ours
        return checkpoint_name

    def spellings(self, name: str) -> tuple[str, ...]:
        for ours, spellings in EXPERT_NAMES.items():
            if name.endswith(ours):
                return tuple(name[: -len(ours)] + s for s in spellings)
        return (name,)
