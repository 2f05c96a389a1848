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
`backbone.`. Both load (`checkpoint_to_param`; the expected names list both spellings, as
Gemma-3's multimodal layouts, and `missing_weights` maps them back).

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

from distengine.kv_cache.model_config import MAMBA, MLP, MOE, PARALLEL, decoder_layer_kinds
from workers.layers.attention import Attention
from workers.layers.linear import ColumnParallelLinear, RowParallelLinear
from workers.layers.mamba import MambaMixer2
from workers.models.bamba import MambaHybridForCausalLM, _model_cls
from workers.models.base import STACKED
from workers.models.llama import LlamaAttention, RMSNorm
from workers.parallel import TPGroup

# Published checkpoints' prefix -> ours.
BACKBONE, MODEL = "backbone.", "model."
QKV_ONLY = [entry for entry in STACKED if entry[0] == "qkv_proj"]


def cfg(config, *names: str, default=None):
    """The first of `names` the config sets (transformers versions and published config.json
    files spell some Nemotron-H fields differently)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def our_name(name: str) -> str:
    return MODEL + name[len(BACKBONE):] if name.startswith(BACKBONE) else name


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# Non-gated MLP activations (transformers' ACT2FN names).
ACTIVATIONS = {"relu2": _relu2, "relu": F.relu, "silu": F.silu, "swish": F.silu, "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class NemotronHMLP(nn.Module):
    """up_proj -> activation -> down_proj (no gate)."""

    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        bias = bool(cfg(config, "mlp_bias", default=False))
        act = cfg(config, "mlp_hidden_act", "hidden_act", default="relu2")
        if act not in ACTIVATIONS:
            raise ValueError(f"{prefix}: MLP activation {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[act]
        self.up_proj = ColumnParallelLinear(h, i, bias, tp, dtype, device, f"{prefix}.up_proj")
        self.down_proj = RowParallelLinear(i, h, bias, tp, dtype, device, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHBlock(nn.Module):
    """norm -> mixer (Mamba-2, attention or MLP) -> residual add (fused into the next norm)."""

    def __init__(self, model: NemotronHForCausalLM, config, i: int, kind: str, tp, dtype, device) -> None:
        super().__init__()
        prefix = f"model.layers.{i}.mixer"
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, model.eps, dtype, device)
        if kind == MAMBA:
            self.mixer = model.mixer(config, tp, dtype, device, prefix)
        elif kind == MLP:
            self.mixer = NemotronHMLP(config, tp, dtype, device, prefix)
        else:  # an attention layer: no RoPE
            self.mixer = LlamaAttention(config, i, kind, tp, dtype, device, prefix, None)

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, h = x, self.norm(x)
        else:
            h, residual = self.norm(x, residual)
        if self.kind == MAMBA:
            h = self.mixer(h, meta)
        elif self.kind == MLP:
            h = self.mixer(h)
        else:
            h = self.mixer(positions, h, meta)
        return h, residual


class NemotronHForCausalLM(MambaHybridForCausalLM):
    def __init__(self, config, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None) -> None:
        self.model_cls = _model_cls("norm_f", "embeddings")
        self.eps = float(cfg(config, "layer_norm_epsilon", "rms_norm_eps", default=1e-5))
        super().__init__(config, tp, dtype, device, max_positions)

    def expert_note(self, config) -> str:
        kinds = decoder_layer_kinds(config.to_dict())
        moe = [i for i, k in enumerate(kinds) if k == MOE]
        return f"{len(moe)} MoE layer(s) ('E' in hybrid_override_pattern / 'moe' in layers_block_type): {moe}"

    def make_layer(self, config, i, kind, tp, dtype, device, rope_cache):
        if kind in (MOE, PARALLEL):
            raise ValueError(f"Nemotron-H: layer {i} has type {kind!r}; supported: Mamba, attention, MLP")
        return NemotronHBlock(self, config, i, kind, tp, dtype, device)

    def final_norm(self, config, dtype, device) -> nn.Module:
        return RMSNorm(config.hidden_size, self.eps, dtype, device)

    def rope_caches(self, config, kinds, device):
        return [None] * len(kinds)  # Nemotron-H's attention has no positional embedding

    def mixer(self, config, tp, dtype, device, prefix):
        bias = bool(cfg(config, "use_bias", "mamba_proj_bias", default=False))
        return MambaMixer2(config.hidden_size, self.shape, tp, dtype, device, prefix,
                           conv_bias=bool(cfg(config, "use_conv_bias", "mamba_conv_bias", default=True)),
                           proj_bias=bias, out_bias=bias,
                           activation=cfg(config, "mamba_hidden_act", default="silu"),
                           rms_norm=True, norm_before_gate=False, eps=self.eps,
                           dt_limit=tuple(cfg(config, "time_step_limit", "mamba_dt_limit",
                                              default=(0.0, float("inf")))))

    def cache_layers(self) -> dict[str, nn.Module]:
        out: dict[str, nn.Module] = {}
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mixer, MambaMixer2):
                out[f"model.layers.{i}"] = layer.mixer
            elif isinstance(getattr(layer.mixer, "attn", None), Attention):
                out[f"model.layers.{i}"] = layer.mixer.attn
        return out

    # ---- weights: `model.` (transformers 5) or `backbone.` (published checkpoints) ----------
    def checkpoint_to_param(self, name: str) -> tuple[str, object]:
        name = our_name(name)
        for fused, part, shard in QKV_ONLY:  # (the MLP's up_proj is not fused)
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def expected_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_checkpoint_shapes()
        out = dict(shapes)
        for name, shape in shapes.items():
            if name.startswith(MODEL):
                out[BACKBONE + name[len(MODEL):]] = shape
        return out

    def missing_weights(self, loaded: set[str]) -> list[str]:
        # Against our own names (the parent's shapes), whichever spelling the tensors came under.
        return sorted(set(super().expected_checkpoint_shapes()) - {our_name(n) for n in loaded})


__all__ = ["NemotronHForCausalLM"]
