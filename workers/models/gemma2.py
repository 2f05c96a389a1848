"""Gemma-2: Llama's layers with

* the embedding scaled by sqrt(hidden), the factor rounded to the embedding dtype as HF does;
* Gemma's RMSNorm, x_normed * (1 + weight), everywhere;
* four norms per layer ("sandwich"): the attention and MLP outputs are each normed before they
  join the residual stream (post_attention / post_feedforward), the MLP input by its own
  pre_feedforward norm;
* a GELU-tanh MLP (`hidden_activation`);
* attention scale `query_pre_attn_scalar ** -0.5` and tanh soft-capping of the attention scores
  (`attn_logit_softcapping`) and of the final logits (`final_logit_softcapping`);
* sliding and full layers alternating (sliding first), as the config's `layer_types` says;
* tied input/output embeddings.
"""
from __future__ import annotations

import torch

from workers.layers.attention import AttentionMetadata
from workers.models.llama import (DecoderModel, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP,
                                  RMSNorm, reduce_add_norm)
from workers.ops import act_and_mul


class GemmaMLP(LlamaMLP):
    """HF's Gemma reads `hidden_activation` (older configs also carry a `hidden_act` it ignores)."""

    def __init__(self, config, tp, dtype, device, prefix: str, bias: bool = False) -> None:
        super().__init__(config, tp, dtype, device, prefix, bias)
        self.act = act_and_mul(getattr(config, "hidden_activation", None) or config.hidden_act)


class Gemma2Attention(LlamaAttention):
    gemma_norm = True

    def scale(self, config) -> float:
        return config.query_pre_attn_scalar ** -0.5

    def softcap(self, config) -> float:
        return float(getattr(config, "attn_logit_softcapping", None) or 0.0)


class Gemma2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Gemma2Attention
    mlp_cls = GemmaMLP
    gemma_norm = True

    def __init__(self, config, layer_idx: int, kind: str, tp, dtype, device, rope_cache) -> None:
        super().__init__(config, layer_idx, kind, tp, dtype, device, rope_cache)
        eps = config.rms_norm_eps
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, gemma=True)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, dtype, device, gemma=True)
        if tp.world_size > 1 and self.forward_declares("reduces_mlp"):
            self.mlp.down_proj.defer_reduce()  # reduced with the norms after it

    reduces_attention = reduces_mlp = True  # (see LlamaDecoderLayer.forward_declares)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor, meta: AttentionMetadata,
                next_norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """HF: r += post_attn_norm(attn(input_norm(r))); r += post_ff_norm(mlp(pre_ff_norm(r))).
        Here `h` is the layer's input already normed (by the layer before, or the model for the
        first), and the layer ends with the next layer's input norm (`next_norm`, the final norm
        after the last layer): each residual add sits between two norms, and the three run as one
        launch (with the all-reduce before them where the NVLink kernel takes it). Both norms feed
        dense projections (the MLP's gate_up, the next layer's qkv)."""
        h, residual = self.attention_out(self.self_attn(positions, h, meta), residual,
                                         self.pre_feedforward_layernorm, pre_norm=self.post_attention_layernorm,
                                         feeds_dense_projection=True)
        return reduce_add_norm(self.tp, self.mlp(h), residual, next_norm, pre_norm=self.post_feedforward_layernorm,
                               reduce=self.mlp.down_proj.deferred, feeds_dense_projection=True)


class GemmaDecoderModel(DecoderModel):
    def __init__(self, config, layers, tp, dtype, device, norm) -> None:
        super().__init__(config, layers, tp, dtype, device, norm)
        # HF: embedding * tensor(hidden ** 0.5) cast to the embedding dtype (bf16 rounds it). Kept
        # as a host scalar rounded the same way: a tensor made in forward() would be a
        # host-to-device copy every step, which a CUDA graph cannot capture.
        self.normalizer = float(torch.tensor(config.hidden_size ** 0.5, dtype=dtype))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.normalizer

    def forward(self, input_ids, positions, meta):
        residual = self.embed(input_ids)
        h = self.layers[0].input_layernorm(residual) if len(self.layers) else self.norm(residual)
        next_norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, next_norms):
            h, residual = layer(positions, h, residual, meta, next_norm)
        return h


def softcap_logits(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap), in HF's order of operations; identity without a cap."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Gemma2DecoderLayer
    model_cls = GemmaDecoderModel

    def final_norm(self, config, dtype, device):
        return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device, gemma=True)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap_logits(super().compute_logits(hidden), getattr(self.config, "final_logit_softcapping", None))
