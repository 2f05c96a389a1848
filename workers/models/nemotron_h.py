"""Nemotron-H: a stack of single-mixer blocks, each `norm -> mixer -> residual add`, the mixer
chosen per layer by `hybrid_override_pattern` (published config.json files: "M" Mamba-2, "*"
attention, "-" MLP, "E" MoE) or `layers_block_type` (transformers 5: linear_attention,
full_attention, mlp, moe), read through the KV cache plan's reader (`decoder_layer_kinds`).

* Mamba-2 mixers with the gated RMSNorm (gate before the norm, groups of intermediate // n_groups
  channels, eps `layer_norm_epsilon`), in_proj / out_proj bias `use_bias`, conv bias
  `use_conv_bias`;
* attention without any positional embedding (no RoPE in Nemotron-H), scale head_dim ** -0.5;
* MLP-only layers: up_proj -> relu2 (`mlp_hidden_act`) -> down_proj, no gate;
* MoE layers ("E", `moe`: Nemotron-3-Nano-30B-A3B) as transformers' NemotronHMoE: the router
  `gate` (logits x W^T in float32 from a float32 weight; sigmoid scores; `e_score_correction_bias`
  added for the choice alone; `n_group` groups of experts of which the `topk_group` with the
  largest sums of their two best biased scores are kept; the top `num_experts_per_tok` of
  those, each weighed by its unbiased score, divided by their sum + 1e-20 when `norm_topk_prob`,
  times `routed_scaling_factor`), `n_routed_experts` ungated experts (up_proj -> relu2 ->
  down_proj, `moe_intermediate_size`) and the ungated `shared_experts` MLP
  (`moe_shared_expert_intermediate_size`, the same activation), added with weight 1. Routed and
  shared experts are one `FusedMoE` stack (the shared one as its last slots), so the layer's
  sum leaves through one all-reduce; the grouped choice is one kernel on a GPU
  (`kernels.moe_routing.topk_sigmoid_grouped`), its torch reference on CPU. Latent projections (`moe_latent_size`) and MLP
  biases on MoE layers are refused;
* FP8 checkpoints (NVIDIA's ModelOpt FP8, per-tensor scales; any format of
  `distengine.quantization`): the Mamba in_proj / out_proj, the MLPs, the attention and the
  routed and shared experts (`Fp8FusedMoE`, ungated) as the config quantizes them; the router
  stays float32;
* the multi-token-prediction layers (`mtp.*`, speculative decoding only) are not built and their
  tensors are not read.

Weight names: transformers 5 saves `model.embeddings`, `model.layers.i.norm`,
`model.layers.i.mixer.*`, `model.norm_f`; the published checkpoints spell `model.` as
`backbone.`. Both load (`our_name`; the expected names list both spellings, as Gemma-3's
multimodal layouts, and `missing_weights` names ours). The experts load from the published
layout (`mixer.experts.{e}.up_proj.weight` [I, H], `down_proj.weight` [H, I], which transformers
5.24 also saves) or transformers' in-memory one (`mixer.experts.up_proj` [E, I, H],
`mixer.experts.down_proj` [E, H, I]); `mixer.shared_experts.{up,down}_proj.weight`,
`mixer.gate.weight`, `mixer.gate.e_score_correction_bias`.

Differences from transformers 5.23 (none shows in the published configs at float32):
* attention biases: HF 5.23 builds q/k/v/o without bias whatever the config says; we follow
  `attention_bias` (False in the published configs, then the same).
* MoE rounding: transformers sums the routed experts in float32 (weights kept in float32), rounds
  that to the model dtype and adds the shared MLP's output in the model dtype; we round each
  token's routing weights to the model dtype, then sum routed and shared experts in float32 and
  round once (the same at float32).
* `residual_in_fp32`: transformers ignores it (the residual stream is in the model dtype); so do
  we. Our fused add rounds the fp32 sum to the model dtype, as HF's add does.
* dt clamp: HF 5.23 clamps softplus(dt) to >= `time_step_min` in its chunked (prefill) path only
  (its decode path does not clamp); `time_step_min` is the dt_bias initializer's bound, while
  NVIDIA's own modeling code clamps to `time_step_limit` ((0, inf) in the published configs) in
  both paths, and vLLM does not clamp. We use `time_step_limit`, in prefill and decode alike:
  prefill logits differ from HF's only where softplus(dt) < time_step_min (1e-3).
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from distengine.model_config import MAMBA, MLP, MOE
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.layers.moe import SCALE_SUFFIX, ExpertWeightNames, FusedMoE, Router
from workers.layers.moe_fp8 import Fp8FusedMoE, experts_class
from workers.models.base import STACKED
from workers.models.hybrid import ATTENTION, HybridDecoderLayer, HybridForCausalLM, HybridModel
from workers.parallel import TPGroup

# Published checkpoints' prefix -> ours.
BACKBONE, MODEL = "backbone.", "model."


def cfg(config, *names: str, default=None):
    """The first of `names` the config sets (transformers versions and published config.json
    files spell some Nemotron-H fields differently)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# Non-gated MLP activations (transformers' ACT2FN names).
ACTIVATIONS = {"relu2": _relu2, "relu": F.relu, "silu": F.silu, "swish": F.silu, "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class NemotronHMLP(nn.Module):
    """up_proj -> activation -> down_proj (no gate)."""

    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str, bias: bool = False) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        act = cfg(config, "mlp_hidden_act", "hidden_act", default="relu2")
        if act not in ACTIVATIONS:
            raise ValueError(f"{prefix}: MLP activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]
        self.up_proj = ColumnParallelLinear(h, i, bias, tp, dtype, device, f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(i, h, bias, tp, dtype, device, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHMoE(nn.Module):
    """The router `gate` and the routed and shared experts (one stack); the layer's output, all-reduced."""

    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str) -> None:
        super().__init__()
        if cfg(config, "moe_latent_size") is not None:
            raise ValueError(f"{prefix}: MoE latent projections (moe_latent_size={config.moe_latent_size}) "
                             f"are not supported yet")
        if cfg(config, "mlp_bias", default=False):
            raise ValueError(f"{prefix}: MoE layers with MLP biases (mlp_bias) are not supported")
        act = cfg(config, "mlp_hidden_act", "hidden_act", default="relu2")
        h, e = config.hidden_size, int(cfg(config, "n_routed_experts", "num_local_experts"))
        shared = int(cfg(config, "moe_shared_expert_intermediate_size", default=0))
        self.tp = tp
        self.gate = Router(h, e, torch.float32, device, name=f"{prefix}.gate", correction_bias=True)
        cls, extra = experts_class(f"{prefix}.experts", gated=False,
                                   shared=f"{prefix}.shared_experts" if shared else None)
        self.experts = cls(
            e, int(config.num_experts_per_tok), h, int(config.moe_intermediate_size), act, tp, dtype, device,
            f"{prefix}.experts", renormalize=bool(cfg(config, "norm_topk_prob", default=True)),
            shared_intermediate=shared, scoring="sigmoid_grouped", gated=False,
            groups=(int(cfg(config, "n_group", default=1)), int(cfg(config, "topk_group", default=1))),
            scale=float(cfg(config, "routed_scaling_factor", default=1.0)), **extra)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # float32, as transformers' router on x.float() (`linear_op` widens x)
        return self.tp.all_reduce(self.experts(x, logits, self.gate.e_score_correction_bias))


class NemotronHBlock(HybridDecoderLayer):
    """norm -> mixer (Mamba-2, attention, MLP or MoE, all named `mixer`) -> residual add (fused
    into the next norm); no second half."""

    kinds = ATTENTION | {MAMBA, MLP, MOE}
    norm_name, ff_norm_name = "norm", None
    mamba_name = attention_name = ff_name = "mixer"
    mlp_cls = NemotronHMLP

    def build_feed_forward(self, config, tp, dtype, device, prefix: str) -> None:
        if self.kind == MOE:
            self.mixer = NemotronHMoE(config, tp, dtype, device, f"{prefix}.mixer")
        else:
            super().build_feed_forward(config, tp, dtype, device, prefix)


# Expert tensors, with `backbone.` already spelled `model.`: published one per expert, or stacked
# (transformers in memory), and the shared expert.
_EXPERTS = ExpertWeightNames(r"mixer\.experts", gated=False)
_SHARED_EXPERT = re.compile(rf"^(.*\.mixer)\.shared_experts\.(up|down)_proj\.weight({SCALE_SUFFIX})?$")


class NemotronHForCausalLM(HybridForCausalLM):
    decoder_layer_cls = NemotronHBlock
    model_cls = HybridModel.named("norm_f", "embeddings")
    stacked = tuple(entry for entry in STACKED if entry[0] == "qkv_proj")  # (the MLP's up_proj is not fused)

    def norm_eps(self, config) -> float:
        return float(cfg(config, "layer_norm_epsilon", "rms_norm_eps", default=1e-5))

    def rope_caches(self, config, kinds, device):
        return [None] * len(kinds)  # Nemotron-H's attention has no positional embedding

    def mixer_options(self, config) -> dict:
        bias = bool(cfg(config, "use_bias", "mamba_proj_bias", default=False))
        return dict(conv_bias=bool(cfg(config, "use_conv_bias", "mamba_conv_bias", default=True)),
                    proj_bias=bias, out_bias=bias, activation=cfg(config, "mamba_hidden_act", default="silu"),
                    rms_norm=True, norm_before_gate=False, eps=self.eps,
                    dt_limit=tuple(cfg(config, "time_step_limit", "mamba_dt_limit", default=(0.0, float("inf")))))

    # ---- weights: `model.` (transformers 5) or `backbone.` (published checkpoints) ----------
    def our_name(self, checkpoint_name: str) -> str:
        if checkpoint_name.startswith(BACKBONE):
            return MODEL + checkpoint_name[len(BACKBONE):]
        return checkpoint_name

    def spellings(self, name: str) -> tuple[str, ...]:
        return (name, BACKBONE + name[len(MODEL):]) if name.startswith(MODEL) else (name,)

    def checkpoint_to_param(self, name: str) -> tuple[str, object]:
        name = self.our_name(name)
        expert = _EXPERTS.param(name)
        if expert:
            return expert
        m = _SHARED_EXPERT.match(name)
        if m:
            ours = f"{'w2' if m[2] == 'down' else 'w13'}{'_scale' if m[3] else ''}"
            return f"{m[1]}.experts.{ours}", ("shared", None if m[2] == "down" else 0)
        return super().checkpoint_to_param(name)

    def checkpoint_sources(self) -> dict[str, list[dict[str, tuple[int, ...]]]]:
        out = super().checkpoint_sources()
        for path, moe in self.named_modules():
            if not isinstance(moe, FusedMoE):
                continue
            mixer = path.rsplit(".", 1)[0]
            e, h, i, s = moe.num_experts, moe.hidden, moe.intermediate, moe.shared_intermediate
            for ours, part, one, shared in (("w13", "up", (i, h), (s, h)), ("w2", "down", (h, i), (h, s))):
                name = f"{path}.{ours}"
                per_expert = {f"{path}.{x}.{part}_proj.weight": one for x in range(e)}
                shared_way = {f"{mixer}.shared_experts.{part}_proj.weight": shared} if s else {}
                if isinstance(moe, Fp8FusedMoE):  # per expert only, each weight with its scale
                    del out[f"{name}_scale"]
                    out[name] = [moe.with_scales({**per_expert, **shared_way})]
                    continue
                out[name] = [{**way, **shared_way} for way in ({f"{path}.{part}_proj": out[name][0][name]}, per_expert)]
        return out


__all__ = ["NemotronHForCausalLM"]
