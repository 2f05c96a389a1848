"""Jamba (AI21's Jamba-v0.1, Jamba-1.5/1.6 Mini and Large): Mamba-1 and attention layers, each
followed by a feed-forward, as transformers' JambaForCausalLM:

* layer i is attention when i % attn_layer_period == attn_layer_offset, else Mamba-1 (read
  through the KV cache plan's reader); each layer `input_layernorm -> mixer -> residual add ->
  pre_ff_layernorm -> feed_forward -> residual add` (the hybrid decoder as it comes);
* Mamba-1 mixers with Jamba's RMSNorms on dt, B and C (`workers/layers/mamba1.py`), in/out_proj
  bias `mamba_proj_bias`, conv bias `mamba_conv_bias`, dt rank `mamba_dt_rank`;
* attention: GQA without any positional embedding (no RoPE in Jamba), scale head_dim ** -0.5;
* feed-forward: routed experts on layer i when num_experts > 1 and i % expert_layer_period ==
  expert_layer_offset (JambaSparseMoeBlock), a silu-gated MLP elsewhere. The router: logits
  x R^T, softmax over all experts in fp32, the top `num_experts_per_tok`, their weights NOT
  renormalised (JambaTopKRouter), rounded to the model dtype; silu-gated experts through the
  fused MoE kernels (`workers/layers/moe.py`), their sum all-reduced once.

Weight names: `model.layers.i.mamba.*`, `.self_attn.{q,k,v,o}_proj`, `.feed_forward.{gate,up,down}_proj`
and `model.final_layernorm`. The experts load from the published layout (and what transformers 5
saves): `feed_forward.experts.{e}.{gate,up,down}_proj.weight`, or transformers' in-memory one:
`feed_forward.experts.gate_up_proj` [E, 2I, H] and `.down_proj` [E, H, I]; the router
`feed_forward.router.weight` in both.

`use_mamba_kernels`, `use_mambapy` and `use_associative_scan` choose transformers' implementation,
not the model: they are ignored. Quantized checkpoints (`quantization_config`) are refused by name.
"""
from __future__ import annotations

import torch
from torch import nn

from workers.layers.linear import refuse_fp8
from workers.layers.mamba1 import MambaMixer1
from workers.layers.moe import ExpertWeightNames, FusedMoE, Router
from workers.models.hybrid import HybridDecoderLayer, HybridForCausalLM, HybridModel
from workers.parallel import TPGroup


def is_expert_layer(config, i: int) -> bool:
    """transformers' `layers_num_experts[i] > 1`."""
    return int(config.num_experts) > 1 and i % int(config.expert_layer_period) == int(config.expert_layer_offset)


class JambaMoE(nn.Module):
    """The router and the routed experts; the layer's output, all-reduced."""

    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str) -> None:
        super().__init__()
        h, e = config.hidden_size, int(config.num_experts)
        self.tp = tp
        self.router = Router(h, e, dtype, device, name=f"{prefix}.router")
        self.experts = FusedMoE(e, int(config.num_experts_per_tok), h, config.intermediate_size,
                                config.hidden_act, tp, dtype, device, f"{prefix}.experts", renormalize=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.experts(x, self.router(x)))


class JambaDecoderLayer(HybridDecoderLayer):
    """The hybrid decoder layer with Jamba's feed-forward: experts on the expert layers."""

    def build_feed_forward(self, config, tp, dtype, device, prefix: str) -> None:
        if is_expert_layer(config, self.index):
            self.feed_forward = JambaMoE(config, tp, dtype, device, f"{prefix}.feed_forward")
        else:
            super().build_feed_forward(config, tp, dtype, device, prefix)


_EXPERTS = ExpertWeightNames(r"feed_forward\.experts")


class JambaForCausalLM(HybridForCausalLM):
    decoder_layer_cls = JambaDecoderLayer
    model_cls = HybridModel.named("final_layernorm")

    def __init__(self, config, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None) -> None:
        refuse_fp8("Jamba", "FP8 serves neither its experts nor its Mamba-1 projections: use a bf16 checkpoint")
        super().__init__(config, tp, dtype, device, max_positions)

    def rope_caches(self, config, kinds, device):
        return [None] * len(kinds)  # Jamba's attention has no positional embedding

    def mixer(self, config, tp, dtype, device, prefix: str) -> nn.Module:
        return MambaMixer1(config.hidden_size, self.shape, int(config.mamba_dt_rank), tp, dtype, device, prefix,
                           conv_bias=bool(getattr(config, "mamba_conv_bias", True)),
                           proj_bias=bool(getattr(config, "mamba_proj_bias", False)),
                           activation=getattr(config, "hidden_act", "silu"), eps=self.eps)

    # ---- weights: the experts one tensor each (published) or stacked (transformers in memory) --
    def checkpoint_to_param(self, name: str) -> tuple[str, object]:
        return _EXPERTS.param(name) or super().checkpoint_to_param(name)

    def checkpoint_sources(self) -> dict[str, list[dict[str, tuple[int, ...]]]]:
        out = super().checkpoint_sources()
        for path, moe in self.named_modules():
            if not isinstance(moe, FusedMoE):
                continue
            e, h, i = moe.num_experts, moe.hidden, moe.intermediate
            out[f"{path}.w13"] = [{f"{path}.gate_up_proj": (e, 2 * i, h)},
                                  {f"{path}.{x}.{part}_proj.weight": (i, h) for x in range(e) for part in ("gate", "up")}]
            out[f"{path}.w2"] = [{f"{path}.down_proj": (e, h, i)},
                                 {f"{path}.{x}.down_proj.weight": (h, i) for x in range(e)}]
        return out


__all__ = ["JambaForCausalLM"]
