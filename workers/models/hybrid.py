"""The decoder of the hybrid models (Bamba, Falcon-H1, Granite-4.0-H, Nemotron-H, Qwen3-Next,
Qwen3.5): each layer a norm, the mixer its kind names, then (in most families) a norm and a
feed-forward.

The kind of every layer comes from the model description (`decoder_layer_kinds`), never from the
model's name; the Mamba shape through the same parser as the KV cache plan's, so the state each
mixer lays out in its pages is the one the plan sized. A family gives what differs as small
parameters and hooks:

* on its decoder layer (`HybridDecoderLayer`): the layer kinds it has, the checkpoint's names of
  the parts, the attention and MLP classes, the feed-forward (`build_feed_forward` /
  `run_feed_forward`, Granite's experts beside its shared MLP);
* on its model (`HybridForCausalLM`): the Mamba mixer's options (`mixer_options`, or `mixer` for
  another mixer: the Gated DeltaNet of the LINEAR layers), the norms' eps and form (`gemma_norm`:
  zero-centred, x * (1 + weight)), the rotary caches, the names of the embedding and the final
  norm (`HybridModel.named`), and other spellings of checkpoint names (`our_name` / `spellings`).

muP-style multipliers are read under transformers' names wherever a config sets them (Falcon-H1,
Granite); where it does not they are 1 and cost no operation.
"""
from __future__ import annotations

import torch
from torch import nn

from distengine.model_config import (CHUNKED, CROSS, FULL, LINEAR, MAMBA, MLP, MOE, PARALLEL, SLIDING,
                                     DeltaNetShape, MambaShape, mamba_layer_name, parse_model_config)
from workers.layers.attention import AttentionMetadata
from workers.layers.mamba import MambaMixer2
from workers.models.llama import DecoderModel, LlamaAttention, LlamaForCausalLM, LlamaMLP, RMSNorm, layer_kinds
from workers.parallel import TPGroup

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
ATTENTION = frozenset({FULL, SLIDING, CHUNKED, CROSS})  # the layer kinds that are an attention
FEED_FORWARD = (MLP, MOE)  # the layer kinds whose mixer is a feed-forward
STATE_MIXERS = (MAMBA, LINEAR)  # the kinds whose mixer is the model's state mixer (`mixer`) alone


def multiplier(config, name: str) -> float:
    value = getattr(config, name, None)
    return 1.0 if value is None else float(value)


def mamba_shape(config, dtype: torch.dtype) -> MambaShape | DeltaNetShape:
    """The state shape (Mamba's, or the Gated DeltaNet's) the KV cache plan reads from this config
    (with the model's dtype, the states', which decides whether a separate SSM state dtype applies)."""
    d = config.to_dict()
    d.setdefault("max_position_embeddings", 1 << 20)
    layers = parse_model_config(d, dtype=DTYPE_NAMES.get(dtype, "bfloat16")).layers
    return next(layer.mamba for layer in layers if layer.mamba is not None)


class HybridDecoderLayer(nn.Module):
    """norm -> mixer -> norm -> feed-forward, each output joining the residual stream in the fused
    add of the norm after it (the next layer's input norm, or the final norm).

    The mixer by kind: MAMBA the model's Mamba mixer, LINEAR its Gated DeltaNet (the same hook
    builds either), an attention kind the attention, PARALLEL both on the same normed input with
    their outputs summed (Falcon-H1), MLP / MOE a feed-forward (`build_feed_forward`, which looks
    at `self.kind` where the two differ). Families without the
    second half (`ff_norm_name` None: Nemotron-H's single-mixer blocks) end the layer after the
    mixer.

    The parts are attributes under the checkpoint's names (`*_name`), so the hooks that run them
    are named apart from any checkpoint name (`run_*`).
    """

    kinds = ATTENTION | {MAMBA}  # the kinds this family's layers are; the model refuses the others
    norm_name, mamba_name, attention_name = "input_layernorm", "mamba", "self_attn"
    ff_norm_name: str | None = "pre_ff_layernorm"
    ff_name = "feed_forward"
    attention_cls = LlamaAttention
    mlp_cls = LlamaMLP
    gemma_norm = False  # the layer norms scale by (1 + weight) (Qwen3-Next's zero-centred norms)

    def __init__(self, model: HybridForCausalLM, config, i: int, kind: str, tp: TPGroup, dtype, device,
                 rope_cache: torch.Tensor | None) -> None:
        super().__init__()
        prefix = f"model.layers.{i}"
        self.index, self.kind, self.tp = i, kind, tp
        setattr(self, self.norm_name, RMSNorm(config.hidden_size, model.eps, dtype, device, gemma=self.gemma_norm))
        if self.ff_norm_name is not None:
            setattr(self, self.ff_norm_name,
                    RMSNorm(config.hidden_size, model.eps, dtype, device, gemma=self.gemma_norm))
        if kind in (*STATE_MIXERS, PARALLEL):
            setattr(self, self.mamba_name, model.mixer(config, tp, dtype, device, f"{prefix}.{self.mamba_name}"))
        if self.has_attention:
            setattr(self, self.attention_name, self.attention_cls(config, i, kind, tp, dtype, device,
                                                                  f"{prefix}.{self.attention_name}", rope_cache))
        if kind in FEED_FORWARD or self.ff_norm_name is not None:
            self.build_feed_forward(config, tp, dtype, device, prefix)
        # Falcon-H1's around the Mamba mixer; Granite's on both halves' outputs.
        self.ssm_in = multiplier(config, "ssm_in_multiplier")
        self.ssm_out = multiplier(config, "ssm_out_multiplier")
        self.residual_multiplier = multiplier(config, "residual_multiplier")

    @property
    def has_attention(self) -> bool:
        return self.kind in ATTENTION or self.kind == PARALLEL

    def build_feed_forward(self, config, tp: TPGroup, dtype, device, prefix: str) -> None:
        setattr(self, self.ff_name, self.mlp_cls(config, tp, dtype, device, f"{prefix}.{self.ff_name}",
                                                 bool(getattr(config, "mlp_bias", False))))

    def run_feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.ff_name)(h)

    def run_mamba(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        m = getattr(self, self.mamba_name)(h * self.ssm_in if self.ssm_in != 1.0 else h, meta)
        return m * self.ssm_out if self.ssm_out != 1.0 else m

    def run_attention(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return getattr(self, self.attention_name)(positions, h, meta)

    def mix(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.kind in STATE_MIXERS:
            return self.run_mamba(h, meta)
        if self.kind in FEED_FORWARD:
            return self.run_feed_forward(h)
        if self.kind == PARALLEL:
            return self.run_mamba(h, meta) + self.run_attention(positions, h, meta)
        return self.run_attention(positions, h, meta)

    def scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.residual_multiplier if self.residual_multiplier != 1.0 else h

    def forward(self, positions, x, residual, meta):
        norm = getattr(self, self.norm_name)
        if residual is None:
            residual, h = x, norm(x)
        else:
            h, residual = norm(x, residual)
        h = self.mix(positions, h, meta)
        if self.ff_norm_name is None:
            return h, residual
        h, residual = getattr(self, self.ff_norm_name)(self.scaled(h), residual)
        return self.scaled(self.run_feed_forward(h)), residual

    def cache_modules(self) -> dict[str, nn.Module]:
        """Plan layer name -> the module keeping its cache: the attention's KV under the layer's
        name, the Mamba state under `mamba_layer_name` (the layer's, or its own beside attention)."""
        out: dict[str, nn.Module] = {}
        if self.has_attention:
            out[f"model.layers.{self.index}"] = getattr(self, self.attention_name).attn
        if self.kind in (*STATE_MIXERS, PARALLEL):
            out[mamba_layer_name(self.index, self.kind)] = getattr(self, self.mamba_name)
        return out


class HybridModel(DecoderModel):
    """The embedding (times `embedding_multiplier`: Falcon-H1, Granite), the layers, the final norm."""

    def __init__(self, config, layers, tp, dtype, device, norm) -> None:
        super().__init__(config, layers, tp, dtype, device, norm)
        self.embedding_multiplier = multiplier(config, "embedding_multiplier")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(input_ids)
        return x * self.embedding_multiplier if self.embedding_multiplier != 1.0 else x

    @classmethod
    def named(cls, norm_name: str, embed_name: str = "embed_tokens") -> type[HybridModel]:
        """This model with the checkpoint's names of its final norm and embedding."""
        return type(cls.__name__, (cls,), {"norm_name": norm_name, "embed_name": embed_name})


class HybridForCausalLM(LlamaForCausalLM):
    """A hybrid decoder: the family's layer class built per layer kind, its Mamba mixers, and the
    logits times `lm_head_multiplier` (Falcon-H1) or divided by `logits_scaling` (Granite)."""

    decoder_layer_cls = HybridDecoderLayer
    model_cls = HybridModel

    def __init__(self, config, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None) -> None:
        self.refuse_unsupported(layer_kinds(config))  # a clear refusal, before any weight is read
        self.shape = mamba_shape(config, dtype)
        self.eps = self.norm_eps(config)
        super().__init__(config, tp, dtype, device, max_positions)
        self.lm_head_multiplier = multiplier(config, "lm_head_multiplier")
        self.logits_scaling = multiplier(config, "logits_scaling")

    def refuse_unsupported(self, kinds: list[str]) -> None:
        name, supported = type(self).__name__, self.decoder_layer_cls.kinds
        moe = [i for i, kind in enumerate(kinds) if kind == MOE and kind not in supported]
        if moe:
            raise ValueError(f"{name}: mixture-of-experts layers are not supported yet (this config has MoE layers "
                             f"{moe}); only the dense variants run")
        for i, kind in enumerate(kinds):
            if kind not in supported:
                raise ValueError(f"{name}: layer {i} has type {kind!r}; its layers are {', '.join(sorted(supported))}")

    def norm_eps(self, config) -> float:
        return config.rms_norm_eps

    def make_layer(self, config, i, kind, tp, dtype, device, rope_cache) -> nn.Module:
        return self.decoder_layer_cls(self, config, i, kind, tp, dtype, device, rope_cache)

    def final_norm(self, config, dtype, device) -> nn.Module:
        return RMSNorm(config.hidden_size, self.eps, dtype, device, gemma=self.decoder_layer_cls.gemma_norm)

    def mixer(self, config, tp, dtype, device, prefix: str) -> nn.Module:
        return MambaMixer2(config.hidden_size, self.shape, tp, dtype, device, prefix, **self.mixer_options(config))

    def mixer_options(self, config) -> dict:
        """MambaMixer2's options from Bamba's config fields (Granite-4.0-H spells them alike)."""
        return dict(conv_bias=bool(getattr(config, "mamba_conv_bias", True)),
                    proj_bias=bool(getattr(config, "mamba_proj_bias", False)),
                    activation=getattr(config, "hidden_act", "silu"), eps=self.eps,
                    dt_limit=tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf"))))

    def cache_layers(self) -> dict[str, nn.Module]:
        return {name: m for layer in self.model.layers for name, m in layer.cache_modules().items()}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.lm_head_multiplier != 1.0:
            logits = logits * self.lm_head_multiplier
        return logits / self.logits_scaling if self.logits_scaling != 1.0 else logits

    # ---- weights: checkpoints that spell some names otherwise --------------------------------
    def our_name(self, checkpoint_name: str) -> str:
        """Our name for a tensor, whichever spelling the checkpoint has."""
        return checkpoint_name

    def spellings(self, name: str) -> tuple[str, ...]:
        """The checkpoint names our `name` may come under; the first is the one reported missing."""
        return (name,)

    def checkpoint_to_param(self, name: str) -> tuple[str, object]:
        return super().checkpoint_to_param(self.our_name(name))

    def checkpoint_sources(self) -> dict[str, list[dict[str, tuple[int, ...]]]]:
        """Each parameter (or fused part) of ours -> the ways a checkpoint may fill it, each a set
        of tensors (our spelling of their names) with their full shapes; one way, the tensor of
        our name, unless a family keeps some weights under several layouts (experts stacked or
        one tensor each)."""
        return {name: [{name: shape}] for name, shape in super().expected_checkpoint_shapes().items()}

    def expected_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return {spelling: shape for ways in self.checkpoint_sources().values() for way in ways
                for name, shape in way.items() for spelling in self.spellings(name)}

    def missing_weights(self, loaded: set[str]) -> list[str]:
        """Our parameters that no complete set of tensors filled, named by the set the checkpoint
        came closest to (the first one if it has none of them)."""
        have = {self.our_name(n) for n in loaded}
        missing: list[str] = []
        for ways in self.checkpoint_sources().values():
            if any(all(n in have for n in way) for way in ways):
                continue
            closest = max(ways, key=lambda way: sum(n in have for n in way))
            missing += [self.spellings(n)[0] for n in closest if n not in have]
        return sorted(missing)
