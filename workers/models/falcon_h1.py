"""Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side on the same normed input,
their outputs summed into the residual stream, then a pre-norm gated MLP:

    h = input_layernorm(r)
    r = r + mamba(h * ssm_in_multiplier) * ssm_out_multiplier
          + attn(h * attention_in_multiplier) * attention_out_multiplier
    r = r + mlp(pre_ff_layernorm(r))

with muP multipliers everywhere (transformers' FalconH1 names):
* `key_multiplier` scales the keys (before RoPE, so the cached keys are scaled);
* `ssm_multipliers` (z, x, B, C, dt): the mixer's in_proj output per segment (the "mup vector",
  MambaMixer2's `proj_scale`);
* `mlp_multipliers` (gate, down): the gate projection's output before the activation, and the
  MLP's output;
* `embedding_multiplier` on the embedding, `lm_head_multiplier` on the logits.

The Mamba mixer: `mamba_d_ssm` channels (else expand * hidden), optional gated RMSNorm
(`mamba_rms_norm`, groups of d_ssm // n_groups channels, `mamba_norm_before_gate`; without it the
output is y * silu(z)), in_proj bias `mamba_proj_bias`, out_proj bias `projectors_bias`.

Two cache entries per layer: the attention's KV under "model.layers.{i}", the Mamba state under
"model.layers.{i}.mamba" (`mamba_layer_name`).
"""
from __future__ import annotations

import torch

from distengine.model_config import PARALLEL
from workers.layers.attention import AttentionMetadata
from workers.models.hybrid import HybridDecoderLayer, HybridForCausalLM, HybridModel, multiplier
from workers.models.llama import LlamaAttention, LlamaMLP
from workers.ops import rotary_op


class FalconH1Attention(LlamaAttention):
    def __init__(self, config, layer_idx, kind, tp, dtype, device, prefix, rope_cache) -> None:
        super().__init__(config, layer_idx, kind, tp, dtype, device, prefix, rope_cache)
        self.in_mult = multiplier(config, "attention_in_multiplier")
        self.key_mult = multiplier(config, "key_multiplier")
        self.out_mult = multiplier(config, "attention_out_multiplier")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        if self.in_mult != 1.0:
            x = x * self.in_mult
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        if self.key_mult != 1.0:
            k.mul_(self.key_mult)  # (a view of this step's fresh qkv output)
        q = q.view(n, -1, self.head_dim)
        k = k.view(n, -1, self.head_dim)
        if self.rope_cache is not None:
            # The rotary launch stores the keys and the values too.
            rotary_op(q, k, positions, self.rope_cache, kv_write=self.attn.kv_write(v, meta))
        out = self.o_proj(self.attn(q, k, v, meta, stored=self.rope_cache is not None))
        return out * self.out_mult if self.out_mult != 1.0 else out


class FalconH1MLP(LlamaMLP):
    """gate_proj's output times the gate multiplier before the activation; the output times the
    down multiplier."""

    def __init__(self, config, tp, dtype, device, prefix: str, bias: bool = False) -> None:
        super().__init__(config, tp, dtype, device, prefix, bias)
        mults = getattr(config, "mlp_multipliers", None) or (1.0, 1.0)
        self.gate_mult, self.down_mult = float(mults[0]), float(mults[1])
        self.gate_local = self.gate_up_proj.weight.shape[0] // 2  # this rank's [gate | up]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gate_mult != 1.0:
            gate_up[..., :self.gate_local] *= self.gate_mult
        out = self.down_proj(self.act(gate_up))
        return out * self.down_mult if self.down_mult != 1.0 else out


class FalconH1DecoderLayer(HybridDecoderLayer):
    """Attention and the Mamba mixer side by side (`ssm_in_multiplier` / `ssm_out_multiplier`
    around the mixer), then the pre-norm MLP."""

    kinds = frozenset({PARALLEL})
    attention_cls = FalconH1Attention
    mlp_cls = FalconH1MLP


class FalconH1ForCausalLM(HybridForCausalLM):
    decoder_layer_cls = FalconH1DecoderLayer
    model_cls = HybridModel.named("final_layernorm")

    def mixer_options(self, config) -> dict:
        scale = [float(m) for m in (getattr(config, "ssm_multipliers", None) or [1.0] * 5)]
        return {**super().mixer_options(config), "out_bias": bool(getattr(config, "projectors_bias", False)),
                "rms_norm": bool(getattr(config, "mamba_rms_norm", False)),
                "norm_before_gate": bool(getattr(config, "mamba_norm_before_gate", True)),
                "proj_scale": None if all(m == 1.0 for m in scale) else scale}
