"""Qwen3-Next (Qwen3NextForCausalLM): Gated DeltaNet layers (LINEAR) and gated full-attention
layers, in the config's `layer_types` (the published config.json has none: every
`full_attention_interval`-th layer is attention), each followed by a sparse MoE block or an MLP.

* the decoder's norms are zero-centred RMSNorms, x * (1 + weight) (the input and post-attention
  norms, the final norm, q_norm and k_norm);
* the attention: q_proj gives each head [query | gate]; q_norm and k_norm per head; partial
  rotary (`partial_rotary_factor`, 0.25: the first head_dim / 4 dims of each head rotate);
  attention; the output times sigmoid(gate) (the config's `attn_output_gate`, which transformers
  does not read: always gated); o_proj;
* the Gated DeltaNet layers (`workers/layers/gated_deltanet.py`) with Qwen3-Next's interleaved
  projections `in_proj_qkvz` / `in_proj_ba`;
* the sparse MoE block on layer i when `num_experts` > 0, i is not in `mlp_only_layers` and
  (i + 1) % `decoder_sparse_step` == 0, else an MLP of `intermediate_size`: the router's
  softmax over all experts, the top `num_experts_per_tok` (renormalised when `norm_topk_prob`),
  the routed experts of `moe_intermediate_size` (`workers/layers/moe.py`), plus the shared
  expert (an MLP of `shared_expert_intermediate_size`) times sigmoid(`shared_expert_gate`),
  computed as more experts of the same stack; the sum leaves the layer through one all-reduce.

Checkpoint names: the routed experts per expert (`mlp.experts.{e}.gate_proj.weight`,
`up_proj`, `down_proj`: the published checkpoints, and what transformers' save_pretrained
writes) or stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]:
transformers 5 in memory); both load. The multi-token-prediction layers (`mtp.*`, speculative
decoding only) are not built and their tensors not read.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from distengine.model_config import FULL, LINEAR
from workers.layers.gated_deltanet import DeltaNetProjection, GatedDeltaNet
from workers.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from workers.layers.moe import SCALE_SUFFIX, ExpertWeightNames, FusedMoE, Router
from workers.layers.moe_fp8 import Fp8FusedMoE, experts_class
from workers.models.base import DecoderForCausalLM
from workers.models.hybrid import HybridDecoderLayer, HybridForCausalLM
from workers.models.llama import LlamaAttention
from workers.ops import act_and_mul
from workers.parallel import TPGroup


class Qwen3NextAttention(LlamaAttention):
    qk_norm = True
    gemma_norm = True
    output_gate = True

    def __init__(self, config, layer_idx: int, kind: str, tp: TPGroup, dtype, device, prefix: str,
                 rope_cache: torch.Tensor | None) -> None:
        if getattr(config, "attn_output_gate", True) is False:
            raise ValueError(f"{prefix}: attention without its output gate (attn_output_gate false) is not supported")
        super().__init__(config, layer_idx, kind, tp, dtype, device, prefix, rope_cache)


class Qwen3NextMLP(nn.Module):
    """gate_proj / up_proj (column-parallel, fused) -> act(gate) * up -> down_proj (row-parallel)."""

    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str, intermediate: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.gate_up_proj = MergedColumnParallelLinear(h, [intermediate, intermediate], False, tp, dtype, device,
                                                       f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate, h, False, tp, dtype, device, f"{prefix}.down_proj")
        self.act = act_and_mul(getattr(config, "hidden_act", None) or "silu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x), act=self.act)  # (inside an FP8 down_proj's one-row GEMV)


class Qwen3NextSparseMoe(nn.Module):
    """The router (`gate`, with the shared expert's gate as its last row), the routed experts
    and the shared expert in one stack (`workers/layers/moe.py`), and one all-reduce for their
    sum (the shared gate is replicated, so it scales each rank's partial sum alike)."""

    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str, renormalize: bool) -> None:
        super().__init__()
        h, e = config.hidden_size, int(config.num_experts)
        self.tp = tp
        self.gate = Router(h, e, dtype, device, shared_gate=True, name=f"{prefix}.gate")
        shared = int(config.shared_expert_intermediate_size)
        cls, extra = experts_class(f"{prefix}.experts", shared=f"{prefix}.shared_expert" if shared else None)
        self.experts = cls(e, int(config.num_experts_per_tok), h, int(config.moe_intermediate_size),
                           getattr(config, "hidden_act", None) or "silu", tp, dtype, device, f"{prefix}.experts",
                           renormalize=renormalize, shared_intermediate=shared, **extra)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.experts(x, self.gate(x)))


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    kinds = frozenset({FULL, LINEAR})
    norm_name, mamba_name, attention_name = "input_layernorm", "linear_attn", "self_attn"
    ff_norm_name, ff_name = "post_attention_layernorm", "mlp"
    attention_cls = Qwen3NextAttention
    gemma_norm = True

    def is_moe(self, config) -> bool:
        i = self.index
        return (int(getattr(config, "num_experts", 0) or 0) > 0 and i not in (config.mlp_only_layers or [])
                and (i + 1) % int(config.decoder_sparse_step) == 0)

    def renormalize(self, config) -> bool:
        return bool(getattr(config, "norm_topk_prob", True))

    def build_feed_forward(self, config, tp, dtype, device, prefix: str) -> None:
        name = f"{prefix}.{self.ff_name}"
        ff = Qwen3NextSparseMoe(config, tp, dtype, device, name, self.renormalize(config)) if self.is_moe(config) \
            else Qwen3NextMLP(config, tp, dtype, device, name, int(config.intermediate_size))
        setattr(self, self.ff_name, ff)


# Checkpoint tensors filling one parameter of ours whose names are not ours: the DeltaNet
# projection's parts, the experts one at a time or stacked, the shared expert and its gate.
_IN_PROJ = re.compile(rf"^(.*\.linear_attn\.in_proj)_(qkvz|ba|qkv|z|b|a)\.weight({SCALE_SUFFIX})?$")
_EXPERTS = ExpertWeightNames(r"mlp\.experts")
_SHARED_EXPERT = re.compile(rf"^(.*\.mlp)\.shared_expert\.(gate|up|down)_proj\.weight({SCALE_SUFFIX})?$")
_SHARED_GATE = re.compile(r"^(.*\.mlp)\.shared_expert_gate\.weight$")
_HALF = {"gate": 0, "up": 1, "down": None}


class Qwen3NextForCausalLM(HybridForCausalLM):
    decoder_layer_cls = Qwen3NextDecoderLayer
    projection_layout = "interleaved"  # the Gated DeltaNet's checkpoint projections (gated_deltanet.LAYOUTS)
    ignored_prefixes = ("mtp.",)

    def __init__(self, config, tp: TPGroup, dtype, device, max_positions: int | None = None) -> None:
        super().__init__(self.text_part(config), tp, dtype, device, max_positions)
        self.hf_config = config

    def text_part(self, config):
        return config

    def norm_eps(self, config) -> float:
        return float(config.rms_norm_eps)

    def mixer(self, config, tp, dtype, device, prefix: str) -> nn.Module:
        return GatedDeltaNet(config.hidden_size, self.shape, tp, dtype, device, prefix, eps=self.eps,
                             activation=getattr(config, "hidden_act", None) or "silu", layout=self.projection_layout)

    # ---- weights -------------------------------------------------------------------------
    def checkpoint_to_param(self, name: str) -> tuple[str, object]:
        name = self.our_name(name)
        m = _IN_PROJ.match(name)
        if m:
            return f"{m[1]}.{self.get_submodule(m[1]).param_of(m[2], bool(m[3]))}", m[2]
        expert = _EXPERTS.param(name)
        if expert:
            return expert
        m = _SHARED_EXPERT.match(name)
        if m and isinstance(self.get_submodule(m[1]), Qwen3NextSparseMoe):
            ours = f"{'w2' if m[2] == 'down' else 'w13'}{'_scale' if m[3] else ''}"
            return f"{m[1]}.experts.{ours}", ("shared", _HALF[m[2]])
        m = _SHARED_GATE.match(name)
        if m:
            return f"{m[1]}.gate.weight", "shared"
        return DecoderForCausalLM.checkpoint_to_param(self, name)

    def checkpoint_sources(self) -> dict[str, list[dict[str, tuple[int, ...]]]]:
        out: dict[str, list[dict[str, tuple[int, ...]]]] = {}
        modules = dict(self.named_modules())
        for name, shape in DecoderForCausalLM.expected_checkpoint_shapes(self).items():
            owner = modules.get(name.rsplit(".", 1)[0])
            if isinstance(owner, DeltaNetProjection):
                if name.endswith(".weight"):  # (its scales and tail come with it)
                    base = name[: -len(".weight")]
                    out[name] = [{f"{base}{tensor}": shape for tensor, shape in owner.checkpoint_tensors().items()}]
            elif isinstance(owner, Fp8FusedMoE) and name.endswith(("_scale", ".b13", ".b2")):
                continue  # (with their weights, below; FP8 experts have no biases)
            elif isinstance(owner, FusedMoE) and name.endswith((".w13", ".w2")):
                base = name.rsplit(".", 1)[0]
                mlp = base.rsplit(".", 1)[0]
                e, h, i, s = owner.num_experts, owner.hidden, owner.intermediate, owner.shared_intermediate
                parts, (rows, cols) = (("gate", "up"), (i, h)) if name.endswith(".w13") else (("down",), (h, i))
                shared_shape = (s, h) if name.endswith(".w13") else (h, s)
                per_expert = {f"{base}.{x}.{p}_proj.weight": (rows, cols) for x in range(e) for p in parts}
                shared = {f"{mlp}.shared_expert.{p}_proj.weight": shared_shape for p in parts} if s else {}
                if isinstance(owner, Fp8FusedMoE):  # per expert only, each weight with its scale
                    out[name] = [owner.with_scales({**per_expert, **shared})]
                    continue
                stacked = {f"{base}.{'gate_up' if name.endswith('.w13') else 'down'}_proj": shape}
                out[name] = [{**way, **shared} for way in (stacked, per_expert)]
            elif isinstance(owner, Router) and owner.weight.shape[0] > owner.num_experts and name.endswith(".weight"):
                mlp = name.rsplit(".", 2)[0]
                out[name] = [{name: shape, f"{mlp}.shared_expert_gate.weight": (1, owner.hidden)}]
            else:
                out[name] = [{name: shape}]
        return out


__all__ = ["Qwen3NextForCausalLM"]
