"""Cohere2 (Command-R7B, Command-A): Llama's attention and MLP in a parallel block, with

* LayerNorm, not RMSNorm: mean-subtracted, a weight and no bias, one per layer plus the final;
* the parallel block: attention and MLP both read the same normed input, and both outputs join
  the residual stream: r = r + attn(ln(r)) + mlp(ln(r));
* 3 sliding : 1 full layers, from the config's `layer_types` (or `sliding_window_pattern`), and
  RoPE on the sliding layers only: the full layers have no positional embedding at all;
* Cohere's interleaved RoPE (channel pairs (2i, 2i+1) rotate together, cos/sin repeat-interleaved),
  where our rotary kernel is neox style (pairs (i, i + d/2)). Choice made here: permute each head's
  rows of q_proj and k_proj at load, evens first then odds, so that pair (2i, 2i+1) lands on
  (i, i + d/2) and the neox kernel (Triton on GPU) computes exactly Cohere's rotation. Q and K get
  the same permutation, so q.k is unchanged (the full layers, which don't rotate, are permuted too,
  harmlessly); V and o_proj are untouched, so the attention output is Cohere's. An FP8
  checkpoint's q/k scales follow their rows (`NeoxRows`).
* logits multiplied by `logit_scale`; tied input/output embeddings.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from distengine.model_config import SLIDING
from workers.layers.attention import AttentionMetadata
from workers.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class CohereLayerNorm(nn.Module):
    """LayerNorm without bias, in fp32 as HF's Cohere2LayerNorm; with a residual: the add first
    (rounded to x's dtype, like HF's adds), returning (out, new_residual) as `rms_norm` does.
    Plain torch: there is no fused kernel for this norm yet (kernels/layernorm.py is RMSNorm only)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        xf = x.to(torch.float32)
        mean = xf.mean(-1, keepdim=True)
        var = (xf - mean).pow(2).mean(-1, keepdim=True)
        out = (self.weight.to(torch.float32) * ((xf - mean) * torch.rsqrt(var + self.eps))).to(x.dtype)
        return (out, x) if residual is not None else out


class Cohere2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, kind: str, tp, dtype, device, rope_cache) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        self.self_attn = LlamaAttention(config, layer_idx, kind, tp, dtype, device, f"{prefix}.self_attn", rope_cache)
        self.mlp = LlamaMLP(config, tp, dtype, device, f"{prefix}.mlp")
        self.input_layernorm = CohereLayerNorm(config.hidden_size, config.layer_norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata):
        """Returns (mlp output, residual + attention output): the next norm adds the two, so the
        sum is HF's (r + attn) + mlp, in its order."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        residual = residual + self.self_attn(positions, h, meta)
        return self.mlp(h), residual


def interleaved_to_neox(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of each head reordered [0, 2, 4, ..., 1, 3, 5, ...] (a q/k weight [heads*d, hidden]
    or bias [heads*d])."""
    perm = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)]).to(t.device)
    return t.unflatten(0, (-1, head_dim))[:, perm].flatten(0, 1)


_QK_ROWS = tuple(f"self_attn.{p}_proj.{t}" for p in "qk" for t in ("weight", "bias"))


class NeoxRows:
    """The q/k checkpoint tensors whose rows a model reorders at load (`interleaved_to_neox`):
    weights and biases, and an FP8 checkpoint's scales with them. Per-channel scales move with
    their rows and a per-tensor one stays; block scales stay too, which holds only while each
    scale block holds whole heads (the reordering then stays inside a block): otherwise the
    model is refused when built."""

    def __init__(self, attention: LlamaAttention, family: str) -> None:
        self.head_dim, fp8 = attention.head_dim, attention.qkv_proj.fp8
        if fp8 is not None and fp8.block is not None and fp8.block[0] % self.head_dim:
            raise ValueError(f"{family}: FP8 q/k scale blocks of {fp8.block[0]} rows hold parts of heads of "
                             f"{self.head_dim}; the rows reordered at load would cross blocks")
        self.scales = () if fp8 is None or fp8.block is not None else \
            tuple(f"self_attn.{p}_proj.{fp8.scale_name}" for p in "qk")

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name.endswith(_QK_ROWS) or name.endswith(self.scales) and t.numel() > 1:
            return interleaved_to_neox(t, self.head_dim)
        return t


class Cohere2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Cohere2DecoderLayer

    def __init__(self, config, tp, dtype, device, max_positions: int | None = None) -> None:
        super().__init__(config, tp, dtype, device, max_positions)
        self.neox_rows = NeoxRows(self.model.layers[0].self_attn, "Cohere2") if len(self.model.layers) else None

    def final_norm(self, config, dtype, device) -> nn.Module:
        return CohereLayerNorm(config.hidden_size, config.layer_norm_eps, dtype, device)

    def rope_caches(self, config, kinds: list[str], device) -> list[torch.Tensor | None]:
        caches = super().rope_caches(config, kinds, device)
        return [cache if kind == SLIDING else None for cache, kind in zip(caches, kinds)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        if self.neox_rows is None:
            return super().load_weights(weights)
        return super().load_weights((name, self.neox_rows(name, t)) for name, t in weights)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) * self.config.logit_scale
