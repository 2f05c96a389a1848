"""Nemotron-H: a stack of single-mixer blocks, each `norm -> mixer -> residual add`, the mixer
chosen per layer by `hybrid_override_pattern` (published config.json files: "M" Mamba-2, "*"
attention, "-" MLP, "E" MoE) or `layers_block_type` (transformers 5: linear_attention,
full_attention, mlp, moe), read through the KV cache plan's reader (`decoder_layer_kinds`).

* Mamba-2 mixers with the gated RMSNorm (gate before the norm, groups of intermediate // n_groups
  channels, eps `layer_norm_epsilon`), in_proj / out_proj bias `use_bias`, conv bias
  `use_conv_bias`;
* attention without any positional embedding (no RoPE in Nemotron-H), scale head_dim ** -0.5;
* MLP-only layers: up_proj -> relu2 (`mlp_hidden_act`) -> down_proj, no gate;
* MoE layers are refused at construction (mixture-of-experts is not supported yet); the
  multi-token-prediction layers (`mtp.*`, speculative decoding only) are not built and their
  tensors are not read.

Weight names: transformers 5 saves `model.embeddings`, `model.layers.i.norm`,
`model.layers.i.mixer.*`, `model.norm_f`; the published checkpoints spell `model.` as
`backbone.`. Both load (`our_name`; the expected names list both spellings, as Gemma-3's
multimodal layouts, and `missing_weights` names ours).

Differences from transformers 5.23 (none shows in the published configs at float32):
* attention biases: HF 5.23 builds q/k/v/o without bias whatever the config says; we follow
  `attention_bias` (False in the published configs, then the same).
* `residual_in_fp32`: transformers ignores it (the residual stream is in the model dtype); so do
  we. Our fused add rounds the fp32 sum to the model dtype, as HF's add does.
* dt clamp: HF 5.23 clamps softplus(dt) to >= `time_step_min` in its chunked (prefill) path only
  (its decode path does not clamp); `time_step_min` is the dt_bias initializer's bound, while
  NVIDIA's own modeling code clamps to `time_step_limit` ((0, inf) in the published configs) in
  both paths, and vLLM does not clamp. We use `time_step_limit`, in prefill and decode alike:
  prefill logits differ from HF's only where softplus(dt) < time_step_min (1e-3).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from distengine.model_config import MAMBA, MLP
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
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


class NemotronHBlock(HybridDecoderLayer):
    """norm -> mixer (Mamba-2, attention or MLP, all named `mixer`) -> residual add (fused into
    the next norm); no second half."""

    kinds = ATTENTION | {MAMBA, MLP}
    norm_name, ff_norm_name = "norm", None
    mamba_name = attention_name = ff_name = "mixer"
    mlp_cls = NemotronHMLP


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


__all__ = ["NemotronHForCausalLM"]
