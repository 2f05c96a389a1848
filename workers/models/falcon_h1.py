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
from torch import nn

from distengine.kv_cache.model_config import PARALLEL
from workers.layers.attention import AttentionMetadata
from workers.layers.mamba import MambaMixer2
from workers.models.bamba import MambaHybridForCausalLM
from workers.models.llama import DecoderModel, LlamaAttention, LlamaMLP, RMSNorm
from workers.ops import rotary_op
from workers.parallel import TPGroup


def multiplier(config, name: str) -> float:
    value = getattr(config, name, None)
    return 1.0 if value is None else float(value)


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
            q, k = rotary_op(q, k, positions, self.rope_cache)
        out = self.o_proj(self.attn(q, k, v, meta))
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


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, model: FalconH1ForCausalLM, config, i: int, kind: str, tp, dtype, device,
                 rope_cache) -> None:
        super().__init__()
        prefix = f"model.layers.{i}"
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mamba = model.mixer(config, tp, dtype, device, f"{prefix}.mamba")
        self.self_attn = FalconH1Attention(config, i, kind, tp, dtype, device, f"{prefix}.self_attn", rope_cache)
        self.feed_forward = FalconH1MLP(config, tp, dtype, device, f"{prefix}.feed_forward",
                                        bool(getattr(config, "mlp_bias", False)))
        self.ssm_in = multiplier(config, "ssm_in_multiplier")
        self.ssm_out = multiplier(config, "ssm_out_multiplier")

    def forward(self, positions, x, residual, meta):
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        m = self.mamba(h * self.ssm_in if self.ssm_in != 1.0 else h, meta)
        if self.ssm_out != 1.0:
            m = m * self.ssm_out
        a = self.self_attn(positions, h, meta)
        h, residual = self.pre_ff_layernorm(m + a, residual)
        return self.feed_forward(h), residual


class FalconH1DecoderModel(DecoderModel):
    norm_name = "final_layernorm"

    def __init__(self, config, layers, tp, dtype, device, norm) -> None:
        super().__init__(config, layers, tp, dtype, device, norm)
        self.embedding_multiplier = multiplier(config, "embedding_multiplier")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(input_ids)
        return x * self.embedding_multiplier if self.embedding_multiplier != 1.0 else x


class FalconH1ForCausalLM(MambaHybridForCausalLM):
    model_cls = FalconH1DecoderModel

    def __init__(self, config, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None) -> None:
        super().__init__(config, tp, dtype, device, max_positions)
        self.lm_head_multiplier = multiplier(config, "lm_head_multiplier")

    def make_layer(self, config, i, kind, tp, dtype, device, rope_cache):
        if kind != PARALLEL:
            raise ValueError(f"Falcon-H1: layer {i} has type {kind!r}; every Falcon-H1 layer runs attention "
                             f"and Mamba side by side")
        return FalconH1DecoderLayer(self, config, i, kind, tp, dtype, device, rope_cache)

    def mixer(self, config, tp, dtype, device, prefix):
        proj_bias = bool(getattr(config, "mamba_proj_bias", False))
        scale = [float(m) for m in (getattr(config, "ssm_multipliers", None) or [1.0] * 5)]
        return MambaMixer2(config.hidden_size, self.shape, tp, dtype, device, prefix,
                           conv_bias=bool(getattr(config, "mamba_conv_bias", True)), proj_bias=proj_bias,
                           out_bias=bool(getattr(config, "projectors_bias", False)),
                           activation=getattr(config, "hidden_act", "silu"),
                           rms_norm=bool(getattr(config, "mamba_rms_norm", False)),
                           norm_before_gate=bool(getattr(config, "mamba_norm_before_gate", True)),
                           eps=config.rms_norm_eps,
                           dt_limit=tuple(getattr(config, "time_step_limit", None) or (0.0, float("inf"))),
                           proj_scale=None if all(m == 1.0 for m in scale) else scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        return logits * self.lm_head_multiplier if self.lm_head_multiplier != 1.0 else logits
