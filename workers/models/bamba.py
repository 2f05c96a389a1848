"""Bamba: Mamba-2 layers and a few full-attention layers (`attn_layer_indices`), each followed by
a gated MLP; also the template of the other Mamba-2 hybrids (`MambaHybridForCausalLM`).

Every layer's type comes from the config through the KV cache plan's reader
(`decoder_layer_kinds`); the Mamba shape through the same parser as the plan's, so the state
each mixer lays out in its pages is the one the plan sized.
"""
from __future__ import annotations

import torch
from torch import nn

from distengine.kv_cache.model_config import MAMBA, MLP, MOE, PARALLEL, MambaShape, mamba_layer_name, parse_model_config
from workers.layers.mamba import MambaMixer2
from workers.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm
from workers.parallel import TPGroup

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def mamba_shape(config, dtype: torch.dtype) -> MambaShape:
    """The Mamba shape the KV cache plan reads from this config (with the cache's dtype, which
    decides whether a separate SSM state dtype applies)."""
    d = config.to_dict()
    d.setdefault("max_position_embeddings", 1 << 20)
    layers = parse_model_config(d, kv_cache_dtype=DTYPE_NAMES.get(dtype, "bfloat16")).layers
    return next(layer.mamba for layer in layers if layer.mamba is not None)


class MambaHybridForCausalLM(LlamaForCausalLM):
    """A decoder whose layers are attention or Mamba-2 (or both side by side); subclasses give
    the decoder layer class and the mixer's options read from their config."""

    # MoE layers (Nemotron-H's "E"): a clear refusal (what is missing), before any weight is read.
    def __init__(self, config, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None) -> None:
        from workers.models.llama import layer_kinds
        kinds = layer_kinds(config)
        if MOE in kinds:
            raise ValueError(f"{type(self).__name__}: mixture-of-experts layers are not supported yet (this config "
                             f"has {self.expert_note(config)}); only the dense variants run")
        self.shape = mamba_shape(config, dtype)
        super().__init__(config, tp, dtype, device, max_positions)

    def expert_note(self, config) -> str:
        return "MoE layers"

    def mixer(self, config, tp, dtype, device, prefix: str) -> MambaMixer2:
        """The mixer from Bamba's config fields (Granite-4.0-H spells them alike)."""
        return MambaMixer2(config.hidden_size, self.shape, tp, dtype, device, prefix,
                           conv_bias=bool(getattr(config, "mamba_conv_bias", True)),
                           proj_bias=bool(getattr(config, "mamba_proj_bias", False)),
                           activation=getattr(config, "hidden_act", "silu"), eps=config.rms_norm_eps,
                           dt_limit=tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf"))))

    def cache_layers(self) -> dict[str, nn.Module]:
        out: dict[str, nn.Module] = {}
        for i, layer in enumerate(self.model.layers):
            attn = getattr(layer, "self_attn", None)
            mamba = getattr(layer, "mamba", None)
            if attn is not None:
                out[f"model.layers.{i}"] = attn.attn
            if mamba is not None:
                out[mamba_layer_name(i, PARALLEL if attn is not None else MAMBA)] = mamba
        return out


class BambaDecoderLayer(nn.Module):
    """Pre-norm attention or Mamba-2, then a pre-norm gated MLP."""

    def __init__(self, model: MambaHybridForCausalLM, config, i: int, kind: str, tp, dtype, device, rope_cache) -> None:
        super().__init__()
        prefix = f"model.layers.{i}"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        if kind == MAMBA:
            self.mamba = model.mixer(config, tp, dtype, device, f"{prefix}.mamba")
        else:
            self.self_attn = LlamaAttention(config, i, kind, tp, dtype, device, f"{prefix}.self_attn", rope_cache)
        self.feed_forward = LlamaMLP(config, tp, dtype, device, f"{prefix}.feed_forward",
                                     bool(getattr(config, "mlp_bias", False)))

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.mamba(h, meta) if hasattr(self, "mamba") else self.self_attn(positions, h, meta)
        h, residual = self.pre_ff_layernorm(h, residual)
        return self.feed_forward(h), residual


class BambaForCausalLM(MambaHybridForCausalLM):
    def __init__(self, config, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None) -> None:
        self.model_cls = _model_cls("final_layernorm")
        super().__init__(config, tp, dtype, device, max_positions)

    def make_layer(self, config, i, kind, tp, dtype, device, rope_cache):
        if kind in (MLP, MOE, PARALLEL):
            raise ValueError(f"Bamba: layer {i} has type {kind!r}; Bamba layers are attention or Mamba")
        return BambaDecoderLayer(self, config, i, kind, tp, dtype, device, rope_cache)


def _model_cls(norm_name: str, embed_name: str = "embed_tokens"):
    """A DecoderModel whose final norm / embedding carry the checkpoint's names."""
    from workers.models.llama import DecoderModel
    return type(f"DecoderModel_{embed_name}_{norm_name}", (DecoderModel,),
                {"norm_name": norm_name, "embed_name": embed_name})
