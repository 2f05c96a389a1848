"""Gemma 4 (text): Gemma4ForCausalLM, and the language model of Gemma4ForConditionalGeneration.
As transformers' Gemma4TextModel:

* sliding and full attention layers (`layer_types`), each with its own head size and KV heads
  (`per_layer_config`: the full layers' `global_head_dim`, and `num_global_key_value_heads` with
  `attention_k_eq_v`); the sliding layers attend to their last `sliding_window` tokens;
* per head: q gets q_norm then RoPE; k gets k_norm then RoPE; v gets v_norm (an RMSNorm without
  weight). With `attention_k_eq_v` the full layers have no v_proj: the values are the key
  projection's output, normed by v_norm only (no k_norm, no RoPE). Attention scale 1.0 (the
  norms set the scale), no attention soft-capping;
* RoPE per layer type from `rope_parameters`: sliding "default"; full "proportional": the first
  partial_rotary_factor * head_dim / 2 frequencies of the whole head (exponents over head_dim),
  the rest zero, rotating pairs (i, i + head_dim / 2) (`kernels.rotary.rope_inv_freq`): one cos /
  sin cache of the whole head size, its unrotated channels with cos 1, sin 0;
* Gemma4RMSNorm scales by `weight` (not Gemma-2/3's 1 + weight);
* KV sharing (`num_kv_shared_layers`): the last layers compute queries only and attend to the
  K/V of the last earlier layer of their type (the KV cache plan's `shared_layers`: bound to
  that layer's cache view, they store nothing); with `use_double_wide_mlp` their MLP is twice
  `intermediate_size`;
* per-layer inputs (`hidden_size_per_layer_input` P, L layers): each token's row of
  `embed_tokens_per_layer` (L x P, times sqrt(P)) plus `per_layer_projection_norm` (over each P)
  of `per_layer_model_projection`(the scaled embedding) times hidden ** -0.5, the sum times
  2 ** -0.5, gives layer i its input_i. After its MLP a layer adds
  post_per_layer_input_norm(per_layer_projection(gelu(per_layer_input_gate(h)) * input_i));
* each layer's output is multiplied by its `layer_scalar` (a checkpoint buffer);
* `enable_moe_block`: routed experts beside the dense MLP, both fed from the attention block's
  output (the MLP's residual): the MLP's output normed by post_feedforward_layernorm_1, the
  experts' (input normed by pre_feedforward_layernorm_2) by post_feedforward_layernorm_2, their
  sum by post_feedforward_layernorm (the router: `Gemma4Router`);
* embedding times sqrt(hidden) rounded to the weights' dtype, tied LM head, final-logit
  soft-capping when configured.

Tensor parallelism as Gemma 3: query heads split, KV heads split or replicated when fewer than
the ranks; the per-layer-input projections and the router are small and replicated; the
per-layer embedding table is split by vocabulary as the main one; each expert's intermediate
size is split (`workers.layers.moe`).

Gemma4ForConditionalGeneration: its text weights under `model.language_model.`; the vision and
audio towers and their embedders are not read; images and audio are refused by the engine's
input checks. `use_bidirectional_attention="all"` (every token attending both ways) is refused.
"""
from __future__ import annotations

import torch
from torch import nn

from distengine.model_config import SLIDING
from kernels.rotary import make_rope_cache
from workers.layers.attention import Attention, AttentionMetadata
from workers.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from workers.layers.linear import QKVParallelLinear, RowParallelLinear
from workers.layers.moe import FusedMoE
from workers.models.base import DecoderForCausalLM, multimodal_shapes, text_name
from workers.models.gemma2 import softcap_logits
from workers.models.llama import LlamaMLP, RMSNorm, layer_kinds
from workers.ops import (act_and_mul, fused_experts_op, linear_op, qk_norm_rope_op, rms_norm_op, rotary_op,
                         topk_softmax_op)
from workers.parallel import TPGroup


def _layer_field(config, i: int, field: str):
    """A layer's head_dim / num_key_value_heads: transformers' `per_layer_config[i]`."""
    plc = getattr(config, "per_layer_config", None)
    if plc is not None:
        try:
            return getattr(plc[i], field)
        except (KeyError, IndexError, AttributeError, TypeError):
            pass
    return getattr(config, field)


def kv_shared_layers(config) -> set[int]:
    n = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    return set(range(config.num_hidden_layers - n, config.num_hidden_layers)) if n else set()


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every rank (loaded as is)."""

    def __init__(self, in_features: int, out_features: int, dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_op(x, self.weight)


class Gemma4Attention(nn.Module):
    def __init__(self, config, layer_idx: int, kind: str, tp: TPGroup, dtype, device, prefix: str,
                 rope_cache: torch.Tensor) -> None:
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = int(_layer_field(config, layer_idx, "head_dim"))
        kv_heads = int(_layer_field(config, layer_idx, "num_key_value_heads"))
        self.shared = layer_idx in kv_shared_layers(config)
        self.k_eq_v = bool(getattr(config, "attention_k_eq_v", False)) and kind != SLIDING
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias, tp, dtype, device,
                                          f"{prefix}.qkv_proj", kv_parts=0 if self.shared else 1 if self.k_eq_v else 2)
        self.o_proj = RowParallelLinear(heads * self.head_dim, config.hidden_size, bias, tp, dtype, device,
                                        f"{prefix}.o_proj")
        eps = config.rms_norm_eps
        self.q_norm = RMSNorm(self.head_dim, eps, dtype, device)
        if not self.shared:
            self.k_norm = RMSNorm(self.head_dim, eps, dtype, device)
            # v_norm has no weight (a ones buffer for the norm op; not a checkpoint tensor)
            self.register_buffer("v_scale", torch.ones(self.head_dim, dtype=dtype, device=device), persistent=False)
        self.eps = eps
        self.rope_cache = rope_cache
        self.attn = Attention(self.qkv_proj.q_heads, self.qkv_proj.kv_heads, self.head_dim, 1.0,
                              f"model.layers.{layer_idx}",
                              sliding_window=config.sliding_window if kind == SLIDING else 0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(n, -1, d)
        if self.shared:
            q = self.q_norm(q)
            q, _ = rotary_op(q, None, positions, self.rope_cache)
            return self.o_proj(self.attn(q, None, None, meta))
        # v first: with k_eq_v it is the key projection before k's norm and rotary (in place)
        v = rms_norm_op(v.reshape(n, -1, d), self.v_scale, self.eps)
        k = k.view(n, -1, d)
        qk_norm_rope_op(q, k, positions, self.rope_cache, self.q_norm.weight, self.k_norm.weight, self.eps,
                        kv_write=self.attn.kv_write(v, meta))
        return self.o_proj(self.attn(q, k, v, meta, stored=True))


class Gemma4Router(nn.Module):
    """transformers' Gemma4TextRouter: logits of rms_norm(x) (no weight) * scale * hidden ** -0.5;
    the softmax over all experts in fp32, the top k renormalised to sum 1 (the softmax over the
    k), each then times its expert's `per_expert_scale`. Replicated on every rank."""

    def __init__(self, config, dtype, device) -> None:
        super().__init__()
        h, e = config.hidden_size, int(config.num_experts)
        self.proj = ReplicatedLinear(h, e, dtype, device)
        self.scale = nn.Parameter(torch.ones(h, dtype=dtype, device=device), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(e, dtype=dtype, device=device), requires_grad=False)
        self.eps, self.root = float(config.rms_norm_eps), h ** -0.5
        self.top_k = int(config.top_k_experts)
        if not 1 <= self.top_k <= e:
            raise ValueError(f"Gemma 4: top_k_experts must be 1 to {e} (num_experts), got {self.top_k}")
        self.register_buffer("ones", torch.ones(h, dtype=dtype, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.proj(rms_norm_op(x, self.ones, self.eps) * self.scale * self.root)
        weights, ids = topk_softmax_op(logits, self.top_k, torch.float32)
        return (weights * self.per_expert_scale.float()[ids]).to(x.dtype), ids


class Gemma4Experts(nn.Module):
    """The router and the experts ([E, 2I, H] gate rows then up rows, [E, H, I], as the
    checkpoint's `experts.gate_up_proj` / `experts.down_proj`), each expert's intermediate size
    split across the ranks; this rank's partial sum all-reduced here."""

    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str) -> None:
        super().__init__()
        self.router = Gemma4Router(config, dtype, device)
        self.experts = FusedMoE(int(config.num_experts), int(config.top_k_experts), config.hidden_size,
                                int(config.moe_intermediate_size), config.hidden_activation, tp, dtype, device,
                                f"{prefix}.experts")
        self.tp = tp

    def forward(self, router_input: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(router_input)
        e = self.experts
        return self.tp.all_reduce(fused_experts_op(x, e.w13, e.w2, weights, ids, e.act))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, kind: str, tp: TPGroup, dtype, device, rope_cache) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        h, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_idx, kind, tp, dtype, device, f"{prefix}.self_attn", rope_cache)
        wide = bool(getattr(config, "use_double_wide_mlp", False)) and self.self_attn.shared
        self.mlp = LlamaMLP(config, tp, dtype, device, f"{prefix}.mlp",
                            intermediate=config.intermediate_size * (2 if wide else 1))
        self.mlp.act = act_and_mul(config.hidden_activation)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(h, eps, dtype, device))
        self.layer_scalar = nn.Parameter(torch.ones(1, dtype=dtype, device=device), requires_grad=False)
        self.per_layer = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.per_layer:
            self.per_layer_input_gate = ReplicatedLinear(h, self.per_layer, dtype, device)
            self.per_layer_projection = ReplicatedLinear(self.per_layer, h, dtype, device)
            self.post_per_layer_input_norm = RMSNorm(h, eps, dtype, device)
            self.act = act_and_mul(config.hidden_activation)  # act(gate) * input as one op
        self.moe = None
        if getattr(config, "enable_moe_block", False):
            # named as the checkpoint: layers.i.router.*, layers.i.experts.*
            self.moe = Gemma4Experts(config, tp, dtype, device, prefix)
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                setattr(self, name, RMSNorm(h, eps, dtype, device))
        self.tp = tp

    def forward(self, positions: torch.Tensor, x: torch.Tensor, per_layer_input: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        a = self.self_attn(positions, self.input_layernorm(x), meta)
        # pre_ff_norm(post_attn_norm(a) + x), and the sum (the MLP's residual)
        h, residual = rms_norm_op(a, self.pre_feedforward_layernorm.weight, self.pre_feedforward_layernorm.eps,
                                  x, pre_weight=self.post_attention_layernorm.weight)
        m = self.mlp(h)
        if self.moe is not None:
            experts = self.moe(residual, self.pre_feedforward_layernorm_2(residual))
            m = self.post_feedforward_layernorm_1(m) + self.post_feedforward_layernorm_2(experts)
        x = self.post_feedforward_layernorm(m) + residual
        if self.per_layer:
            g = self.act(torch.cat([self.per_layer_input_gate(x), per_layer_input], dim=-1))
            x = self.post_per_layer_input_norm(self.per_layer_projection(g)) + x
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, config, layers: list[nn.Module], tp: TPGroup, dtype, device) -> None:
        super().__init__()
        h = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, tp, dtype, device, "model.embed_tokens")
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        # transformers: embedding * tensor(scale) cast to the weights' dtype (a host scalar here)
        self.normalizer = float(torch.tensor(h ** 0.5, dtype=dtype))
        self.per_layer = int(getattr(config, "hidden_size_per_layer_input", 0) or 0)
        if self.per_layer:
            n, p = config.num_hidden_layers, self.per_layer
            self.embed_tokens_per_layer = VocabParallelEmbedding(config.vocab_size_per_layer_input, n * p, tp, dtype,
                                                                 device, "model.embed_tokens_per_layer")
            self.per_layer_normalizer = float(torch.tensor(p ** 0.5, dtype=dtype))
            self.per_layer_model_projection = ReplicatedLinear(h, n * p, dtype, device)
            self.per_layer_projection_norm = RMSNorm(p, config.rms_norm_eps, dtype, device)
            self.projection_scale = h ** -0.5

    @property
    def embedding(self) -> VocabParallelEmbedding:
        return self.embed_tokens

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[tokens, layers, P]: (norm(projection(embeds) * hidden ** -0.5) + embedding) * 2 ** -0.5."""
        n, p = len(self.layers), self.per_layer
        tokens = (self.embed_tokens_per_layer(input_ids) * self.per_layer_normalizer).view(-1, n, p)
        proj = (self.per_layer_model_projection(embeds) * self.projection_scale).view(-1, n, p)
        return (self.per_layer_projection_norm(proj) + tokens) * 2.0 ** -0.5

    def forward(self, input_ids, positions, meta):
        x = self.embed_tokens(input_ids) * self.normalizer
        per_layer = self.per_layer_inputs(input_ids, x) if self.per_layer else None
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, per_layer[:, i] if per_layer is not None else None, meta)
        return self.norm(x)


class Gemma4ForCausalLM(DecoderForCausalLM):
    ignored_prefixes = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")

    def __init__(self, config, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None) -> None:
        super().__init__()
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text, "use_bidirectional_attention", None) == "all":
            raise ValueError("Gemma 4: use_bidirectional_attention='all' (every token attending to later ones) is "
                             "not supported: only causal attention is served")
        self.hf_config, self.config, self.tp = config, text, tp
        self.multimodal = text is not config
        self.max_positions = max_positions or text.max_position_embeddings
        self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", True))
        kinds = layer_kinds(text)
        caches = self.rope_caches(text, kinds, device)
        layers = [Gemma4DecoderLayer(text, i, kind, tp, dtype, device, caches[i]) for i, kind in enumerate(kinds)]
        self.model = Gemma4Model(text, layers, tp, dtype, device)
        self.lm_head = ParallelLMHead(text.vocab_size, text.hidden_size, tp, dtype, device, "lm_head")
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def rope_caches(self, config, kinds: list[str], device) -> list[torch.Tensor]:
        """One cos/sin cache per layer type, of that type's whole head size."""
        cache: dict[str, torch.Tensor] = {}
        out = []
        for i, kind in enumerate(kinds):
            layer_type = "sliding_attention" if kind == SLIDING else "full_attention"
            if layer_type not in cache:
                rp = dict(config.rope_parameters[layer_type])
                head_dim = int(_layer_field(config, i, "head_dim"))
                scaling = rp if rp.get("rope_type", "default") != "default" else None
                cache[layer_type] = make_rope_cache(head_dim, self.max_positions, float(rp["rope_theta"]), scaling,
                                                    torch.float32, device)
            out.append(cache[layer_type])
        return out

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap_logits(super().compute_logits(hidden), getattr(self.config, "final_logit_softcapping", None))

    # ---- weights -------------------------------------------------------------------------
    def checkpoint_to_param(self, name: str) -> tuple[str, object]:
        """Ours nest the router and the experts under `moe`: layers.i.router.* ->
        layers.i.moe.router.*, layers.i.experts.{gate_up,down}_proj -> layers.i.moe.experts.{w13,w2}."""
        name = text_name(name)
        for ckpt, ours in _MOE_NAMES.items():
            if ckpt in name:
                return name.replace(ckpt, ours), None
        return super().checkpoint_to_param(name)

    def text_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        out = {}
        for name, shape in super().expected_checkpoint_shapes().items():
            for ckpt, ours in _MOE_NAMES.items():
                if ours in name:
                    name = name.replace(ours, ckpt)
                    break
            out[name] = shape
        return out

    def expected_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = self.text_checkpoint_shapes()
        return multimodal_shapes(shapes) if self.multimodal else shapes

    def missing_weights(self, loaded: set[str]) -> list[str]:
        return sorted(set(self.text_checkpoint_shapes()) - {text_name(n) for n in loaded})


# checkpoint name part -> ours
_MOE_NAMES = {".router.": ".moe.router.", ".experts.gate_up_proj": ".moe.experts.w13",
              ".experts.down_proj": ".moe.experts.w2"}


__all__ = ["Gemma4ForCausalLM"]
