"""Llama-4 (text): Llama4ForCausalLM, and the language model of the published
Llama4ForConditionalGeneration checkpoints (Scout, Maverick). As transformers' Llama4TextModel:

* two kinds of layer, from `no_rope_layers` (1: a RoPE layer, 0: a NoPE layer; transformers'
  default when the list is empty: every `no_rope_layer_interval`-th layer is NoPE):
  - RoPE layers attend within their chunk of `attention_chunk_size` tokens (the keys of chunk
    p // C for a query at p; the KV cache plan's chunked-local layers), rotate q and k with
    Llama-4's rotary (`rope_parameters`, llama3 scaling on Scout), and, with `use_qk_norm`,
    normalise each q and k head to unit RMS (an L2 norm without weight, eps `rms_norm_eps`)
    after the rotation;
  - NoPE layers attend to every earlier token with no rotary; with `attn_temperature_tuning`
    the query at position p is scaled by log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1
    (in fp32, rounded to q's dtype), as transformers does (on NoPE layers only, every position);
* a routed-experts block on the layers of `moe_layers` (transformers derives it from
  `interleave_moe_layer_step`: layers step - 1, 2 step - 1, ...), a gated MLP of
  `intermediate_size_mlp` on the others. The block: a router without bias picks each token's
  top `num_experts_per_tok` experts; each chosen expert takes the token's hidden state times the
  sigmoid of its logit (the score scales the expert's input, not its output), and a shared
  expert (an MLP of `intermediate_size`, no gate) is always added. The shared expert is kept as
  one more slot of the experts' stack with weight 1 (`workers/layers/moe.py`), so the routed
  and shared experts run in one grouped GEMM pair and leave the layer through one all-reduce.

Rotary: transformers rotates channel pairs (2i, 2i + 1) (a complex product); our rotary kernels
rotate (i, i + d/2). Each head's rows of q_proj and k_proj are permuted at load (evens, then
odds: `cohere2.interleaved_to_neox`), so the neox kernels compute Llama-4's rotation; q and k
get the same permutation, so every q.k (and the per-head norm) is unchanged; the NoPE layers are
permuted too, harmlessly. Since a rotation keeps each head's norm, the L2 norm after the rotation
equals the rotation of the normalised head: one fused launch (`kernels.qk_norm_rope`, weights of
one) does both.

Checkpoint names: transformers' own (it has no conversion mapping for Llama-4: its 4.x and 5.x
names are the same), `model.layers.{i}.feed_forward.experts.gate_up_proj` [E, H, 2I] (gate
columns, then up columns) and `experts.down_proj` [E, I, H], turned into the experts' [E, 2I, H]
and [E, H, I] as they are read; `feed_forward.router.weight`; `feed_forward.shared_expert.
{gate,up,down}_proj.weight`; the dense layers' `feed_forward.{gate,up,down}_proj.weight`. The
multimodal checkpoints keep the language model under `language_model.model.` and its head at
`language_model.lm_head.` (`model.language_model.` / a top-level `lm_head.` are read too); the
vision tower (`vision_model.*`) and the projector (`multi_modal_projector.*`) are not read. The
embeddings are tied as the text config's `tie_word_embeddings` says (transformers ties them so,
also inside the multimodal wrapper). FP8 checkpoints (`distengine.quantization`'s formats, as
llm-compressor writes Llama-4: the experts one tensor each, `experts.{e}.gate_proj.weight` with
its scale) keep their experts in FP8 (`Fp8FusedMoE`, the shared expert in the same stack and
format) and the linear layers the config quantizes; the q/k scales follow their reordered rows
(`cohere2.NeoxRows`). Not read: bf16 experts stored one tensor per expert.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from workers.layers.attention import AttentionMetadata
from workers.layers.moe import SCALE_SUFFIX, ExpertWeightNames, Router
from workers.layers.moe_fp8 import Fp8FusedMoE, experts_class
from workers.models.base import DecoderForCausalLM, multimodal_shapes, text_name
from workers.models.cohere2 import NeoxRows
from workers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, RMSNorm
from workers.ops import qk_norm_rope_op, rotary_op
from workers.parallel import TPGroup



def moe_layers(config) -> set[int]:
    """The layers with routed experts: `moe_layers`, else every `interleave_moe_layer_step`-th."""
    layers = getattr(config, "moe_layers", None)
    if layers is None:
        step = int(getattr(config, "interleave_moe_layer_step", 1) or 1)
        layers = range(step - 1, config.num_hidden_layers, step)
    return set(layers)


def uses_rope(config, layer_idx: int) -> bool:
    """transformers' `use_rope`: `no_rope_layers[i]` (1 rotates; its default NoPE every
    `no_rope_layer_interval`-th layer)."""
    flags = getattr(config, "no_rope_layers", None)
    if not flags:
        interval = int(getattr(config, "no_rope_layer_interval", 4) or 4)
        return (layer_idx + 1) % interval != 0
    if len(flags) != config.num_hidden_layers:
        raise ValueError(f"no_rope_layers has {len(flags)} entries for {config.num_hidden_layers} layers")
    return bool(flags[layer_idx])


class Llama4Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int, kind: str, tp: TPGroup, dtype, device, prefix: str,
                 rope_cache: torch.Tensor | None) -> None:
        super().__init__(config, layer_idx, kind, tp, dtype, device, prefix, rope_cache)
        self.use_rope = uses_rope(config, layer_idx)
        self.l2_norm = bool(getattr(config, "use_qk_norm", True)) and self.use_rope
        self.eps = float(config.rms_norm_eps)
        if self.l2_norm:  # the fused norm's weights: the L2 norm has none
            self.register_buffer("unit", torch.ones(self.head_dim, dtype=dtype, device=device), persistent=False)
        self.temperature = bool(getattr(config, "attn_temperature_tuning", True)) and not self.use_rope
        self.floor_scale = float(getattr(config, "floor_scale", 8192))
        self.attn_scale = float(getattr(config, "attn_scale", 0.1))

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(n, -1, self.head_dim)
        k = k.view(n, -1, self.head_dim)
        if self.rope_cache is not None:
            # The launch that finishes the keys stores them and the values too.
            kv = self.attn.kv_write(v, meta)
            if self.l2_norm:
                qk_norm_rope_op(q, k, positions, self.rope_cache, self.unit, self.unit, self.eps, kv_write=kv)
            else:
                rotary_op(q, k, positions, self.rope_cache, kv_write=kv)
        if self.temperature:
            scale = torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0
            q = (q * scale[:, None, None]).to(q.dtype)
        return self.o_proj(self.attn(q, k, v, meta, stored=self.rope_cache is not None))


class Llama4MoE(nn.Module):
    """`feed_forward` of an expert layer: the router, the routed experts and the shared expert
    (one stack), this rank's partial sum all-reduced here."""

    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str) -> None:
        super().__init__()
        h, e, i = config.hidden_size, int(config.num_local_experts), int(config.intermediate_size)
        self.router = Router(h, e, dtype, device, name=f"{prefix}.router")
        cls, extra = experts_class(f"{prefix}.experts", shared=f"{prefix}.shared_expert")
        self.experts = cls(e, int(config.num_experts_per_tok), h, i, getattr(config, "hidden_act", None) or "silu",
                           tp, dtype, device, f"{prefix}.experts", shared_intermediate=i, scoring="sigmoid",
                           weight_input=True, **extra)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.experts(x, self.router(x)))


class Llama4DecoderLayer(LlamaDecoderLayer):
    """Llama's layer with its feed-forward named `feed_forward`: the experts' block or an MLP."""

    def __init__(self, config, layer_idx: int, kind: str, tp, dtype, device, rope_cache) -> None:
        nn.Module.__init__(self)
        prefix = f"model.layers.{layer_idx}"
        eps = config.rms_norm_eps
        self.self_attn = Llama4Attention(config, layer_idx, kind, tp, dtype, device, f"{prefix}.self_attn",
                                         rope_cache)
        ff = f"{prefix}.feed_forward"
        self.feed_forward = Llama4MoE(config, tp, dtype, device, ff) if layer_idx in moe_layers(config) else \
            LlamaMLP(config, tp, dtype, device, ff, intermediate=int(config.intermediate_size_mlp))
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.tp = tp
        if tp.world_size > 1 and self.forward_declares("reduces_attention"):
            self.self_attn.o_proj.defer_reduce()

    reduces_attention = True

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.attention_out(self.self_attn(positions, h, meta), residual, self.post_attention_layernorm)
        return self.feed_forward(h), residual


_SHARED_EXPERT = re.compile(rf"^(.*\.feed_forward)\.shared_expert\.(gate|up|down)_proj\.weight({SCALE_SUFFIX})?$")
_HALF = {"gate": 0, "up": 1, "down": None}
# checkpoint name suffix -> our parameter's
EXPERT_NAMES = {".experts.gate_up_proj": ".experts.w13", ".experts.down_proj": ".experts.w2"}
# FP8 checkpoints keep the routed experts one tensor each, with their scales.
_EXPERTS = ExpertWeightNames(r"feed_forward\.experts")


class Llama4ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Llama4DecoderLayer
    ignored_prefixes = ("vision_model.", "multi_modal_projector.")

    def __init__(self, config, tp: TPGroup, dtype, device, max_positions: int | None = None) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        super().__init__(text, tp, dtype, device, max_positions)
        self.hf_config = config
        self.multimodal = text is not config
        self.neox_rows = NeoxRows(self.model.layers[0].self_attn, "Llama-4") if len(self.model.layers) else None

    def rope_caches(self, config, kinds: list[str], device) -> list[torch.Tensor | None]:
        caches = super().rope_caches(config, kinds, device)
        return [cache if uses_rope(config, i) else None for i, cache in enumerate(caches)]

    # ---- weights -------------------------------------------------------------------------
    def checkpoint_to_param(self, name: str) -> tuple[str, object]:
        name = text_name(name)
        m = _SHARED_EXPERT.match(name)
        if m:
            ours = f"{'w2' if m[2] == 'down' else 'w13'}{'_scale' if m[3] else ''}"
            return f"{m[1]}.experts.{ours}", ("shared", _HALF[m[2]])
        expert = _EXPERTS.param(name)
        if expert:
            return expert
        for ckpt, ours in EXPERT_NAMES.items():
            if name.endswith(ckpt):
                return name[: -len(ckpt)] + ours, None
        return super().checkpoint_to_param(name)

    def to_our_layout(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor (named in the text model's spelling) in the layout we load."""
        if name.endswith(tuple(EXPERT_NAMES)):  # [E, H, 2I] -> [E, 2I, H]; [E, I, H] -> [E, H, I]
            return t.transpose(1, 2)
        return t if self.neox_rows is None else self.neox_rows(name, t)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def converted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                yield name, self.to_our_layout(text_name(name), t)
        return super().load_weights(converted())

    def text_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every checkpoint tensor of the language model, named as a text-only checkpoint names it."""
        out: dict[str, tuple[int, ...]] = {}
        for name, shape in DecoderForCausalLM.expected_checkpoint_shapes(self).items():
            if name.endswith(("experts.w13_scale", "experts.w2_scale")):
                continue  # (with their FP8 experts' tensors, below)
            for ckpt, ours in EXPERT_NAMES.items():
                if name.endswith(ours):
                    base = name[: -len(ours)]
                    out.update(self._expert_shapes(base, ckpt, ours, shape))
                    break
            else:
                out[name] = shape
        return out

    def _expert_shapes(self, base: str, ckpt: str, ours: str, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """An expert block's checkpoint tensors filling our `ours` (w13 or w2): stacked and stored
        transposed, or (FP8) one tensor per expert, each with its scale; the shared expert's."""
        moe = self.get_submodule(base + ".experts")
        h, i, s = moe.hidden, moe.intermediate, moe.shared_intermediate
        parts, one, shared = (("gate", "up"), (i, h), (s, h)) if ours == ".experts.w13" else (("down",), (h, i), (h, s))
        out = {f"{base}.shared_expert.{p}_proj.weight": shared for p in parts}
        if not isinstance(moe, Fp8FusedMoE):
            return {**out, base + ckpt: (shape[0], shape[2], shape[1])}  # stored transposed
        out.update({f"{base}.experts.{x}.{p}_proj.weight": one for x in range(moe.num_experts) for p in parts})
        return moe.with_scales(out)

    def expected_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """A multimodal config's checkpoint keeps the language model under a prefix: the names
        of each layout are listed (the loader reads the ones the checkpoint has, and
        `missing_weights` maps them back)."""
        shapes = self.text_checkpoint_shapes()
        return multimodal_shapes(shapes) if self.multimodal else shapes

    def missing_weights(self, loaded: set[str]) -> list[str]:
        return sorted(set(self.text_checkpoint_shapes()) - {text_name(n) for n in loaded})


__all__ = ["Llama4ForCausalLM"]
