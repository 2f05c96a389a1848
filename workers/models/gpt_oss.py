"""gpt-oss: Llama's decoder with sliding-window (128) and full attention layers alternating
(`layer_types`), attention sinks, biases on q/k/v/o, YaRN rotary, and routed experts in every
layer:

* attention: a learned logit per query head (`sinks`) joins each softmax's denominator (the
  paged attention kernel's `sinks`); split across ranks with the query heads;
* experts: a router with a bias (top k of its logits, softmax over those k); gated MLPs with
  biases and gpt-oss's clamped activation, g * sigmoid(alpha g) * (u + 1) with g = min(gate,
  limit) and u = clamp(up, -limit, limit) (`swiglu_alpha`, `swiglu_limit`).

Checkpoints in bf16 (transformers' layout) load: `mlp.experts.gate_up_proj` [E, H, 2I] with gate
and up interleaved column by column, `gate_up_proj_bias` [E, 2I] likewise, `down_proj` [E, I, H];
they are turned into the experts' [E, 2I, H] (gate rows, then up rows) and [E, H, I] as they are
read. The published checkpoints (`quantization_config` quant_method "mxfp4") keep the experts in
MXFP4, `gate_up_proj_blocks` / `_scales` and `down_proj_blocks` / `_scales`, rows of outputs (gate
and up interleaved row by row, kept so with their bias: the kernel activates whole pairs) and the
reduction packed along the last axes: they stay 4-bit on the device (`MXFP4FusedMoE`), except in
layers whose experts the config's `modules_to_not_convert` names (transformers' matching rule:
those are read in bf16). Only the experts are ever MXFP4 (as transformers': attention, router,
embeddings and head are bf16).
"""
from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from workers.layers.moe import FusedMoE, Router
from kernels.fused_moe_mxfp4 import SwigluOAI
from workers.layers.moe_mxfp4 import MXFP4FusedMoE
from workers.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from workers.ops import swiglu_oai_op
from workers.parallel import TPGroup


class GptOssAttention(LlamaAttention):
    def __init__(self, config, layer_idx, kind, tp, dtype, device, prefix, rope_cache) -> None:
        super().__init__(config, layer_idx, kind, tp, dtype, device, prefix, rope_cache)
        self.num_heads = config.num_attention_heads
        self.sinks = nn.Parameter(torch.empty(self.qkv_proj.q_heads, dtype=dtype, device=device), requires_grad=False)
        self.attn.sinks = self.sinks.data  # the same storage, not a second parameter

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"sinks": (self.num_heads,)}

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: object = None) -> None:
        if tuple(full.shape) != (self.num_heads,):
            raise ValueError(f"sinks: checkpoint tensor has shape {tuple(full.shape)}, expected ({self.num_heads},)")
        param.data.copy_(full.narrow(0, self.qkv_proj.q_start, self.qkv_proj.q_heads))


class GptOssMoE(nn.Module):
    """`mlp`: the router and the experts; this rank's partial sum, all-reduced here."""

    def __init__(self, config, tp: TPGroup, dtype, device, prefix: str, mlp_bias: bool = False) -> None:
        super().__init__()  # (`mlp_bias` is the dense MLPs' flag: gpt-oss's experts always have biases)
        e, h = config.num_local_experts, config.hidden_size
        # transformers up to 5.17 has no swiglu_alpha and fixes both at these values
        act = SwigluOAI(alpha=float(getattr(config, "swiglu_alpha", None) or 1.702),
                        limit=float(getattr(config, "swiglu_limit", None) or 7.0))
        self.router = Router(h, e, dtype, device, bias=True)
        if mxfp4_experts(config, f"{prefix}.experts"):
            self.experts = MXFP4FusedMoE(e, int(config.num_experts_per_tok), h, config.intermediate_size, act, tp,
                                         dtype, device, f"{prefix}.experts", bias=True)
        else:
            self.experts = FusedMoE(e, int(config.num_experts_per_tok), h, config.intermediate_size,
                                    functools.partial(swiglu_oai_op, alpha=act.alpha, limit=act.limit), tp, dtype,
                                    device, f"{prefix}.experts", bias=True)
        self.tp = tp

    def dummy_weights(self, generator: torch.Generator) -> None:
        """`--load-format dummy`: router weights that spread the choice. With every weight uniform
        in +-1e-3 a normed hidden state's entries are ~1e-3 / sqrt(3), its logits ~1e-3 sqrt(H) / 3
        times the router's scale, and the router's bias (+-1e-3) would pick the same experts for
        every token: a batch would read a few experts where a real model (and the roofline's
        uniform routing) reads E (1 - (1 - k/E)^B). Weights uniform in +-3000 / sqrt(H) and no bias
        give logits of standard deviation ~1 that differ from token to token."""
        bound = 3000.0 / self.router.hidden ** 0.5
        self.router.weight.data.uniform_(-bound, bound, generator=generator)
        self.router.bias.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.experts(x, self.router(x)))


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention
    mlp_cls = GptOssMoE


def quant_method(config) -> str | None:
    quant = getattr(config, "quantization_config", None) or {}
    return quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)


def mxfp4_experts(config, name: str) -> bool:
    """Whether the experts module `name` ("model.layers.3.mlp.experts") is MXFP4 in the checkpoint:
    quant_method "mxfp4" and no `modules_to_not_convert` pattern matching it (transformers'
    `should_convert_module`: a regex from the start up to a module boundary, or a suffix)."""
    if quant_method(config) != "mxfp4":
        return False
    quant = config.quantization_config
    patterns = (quant.get("modules_to_not_convert") if isinstance(quant, dict)
                else getattr(quant, "modules_to_not_convert", None)) or []
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)


# checkpoint name suffix -> our parameter's
EXPERT_NAMES = {".experts.gate_up_proj": ".experts.w13", ".experts.gate_up_proj_bias": ".experts.b13",
                ".experts.down_proj": ".experts.w2", ".experts.down_proj_bias": ".experts.b2",
                ".experts.gate_up_proj_blocks": ".experts.w13_blocks", ".experts.gate_up_proj_scales": ".experts.w13_scales",
                ".experts.down_proj_blocks": ".experts.w2_blocks", ".experts.down_proj_scales": ".experts.w2_scales"}


def our_name(name: str) -> str:
    for ckpt, ours in EXPERT_NAMES.items():
        if name.endswith(ckpt):
            return name[: -len(ckpt)] + ours
    return name


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[..., g0 u0 g1 u1 ...] -> [..., g0 g1 ... u0 u1 ...] along `dim`."""
    idx = [slice(None)] * t.dim()
    gates, ups = list(idx), list(idx)
    gates[dim], ups[dim] = slice(0, None, 2), slice(1, None, 2)
    return torch.cat([t[tuple(gates)], t[tuple(ups)]], dim=dim)


def to_our_layout(name: str, t: torch.Tensor) -> torch.Tensor:
    """A checkpoint's expert tensor in the layout `FusedMoE` loads."""
    if name.endswith(".experts.gate_up_proj"):  # [E, H, 2I] interleaved -> [E, 2I, H] halves
        return _deinterleave(t.transpose(1, 2), 1)
    if name.endswith(".experts.gate_up_proj_bias"):
        return _deinterleave(t, 1)
    if name.endswith(".experts.down_proj"):  # [E, I, H] -> [E, H, I]
        return t.transpose(1, 2)
    return t


class GptOssForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = GptOssDecoderLayer

    def __init__(self, config, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 max_positions: int | None = None) -> None:
        method = quant_method(config)
        if method not in (None, "mxfp4"):
            raise ValueError(f"gpt-oss: {method!r}-quantized checkpoints are not supported (bf16, or the published "
                             f"MXFP4 experts)")
        super().__init__(config, tp, dtype, device, max_positions)

    def checkpoint_to_param(self, name: str) -> tuple[str, object]:
        return super().checkpoint_to_param(our_name(name))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def converted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                # MXFP4 experts keep the checkpoint's interleaved gate/up rows, their bias too
                mxfp4 = ".mlp.experts." in name and isinstance(self.get_submodule(name.rsplit(".", 1)[0]),
                                                                 MXFP4FusedMoE)
                yield name, t if mxfp4 else to_our_layout(name, t)
        return super().load_weights(converted())

    def expected_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for name, shape in super().expected_checkpoint_shapes().items():
            for ckpt, ours in EXPERT_NAMES.items():
                if name.endswith(ours):
                    name = name[: -len(ours)] + ckpt
                    if ours.endswith((".w13", ".w2")):  # stored transposed: [E, H, 2I], [E, I, H]
                        shape = (shape[0], shape[2], shape[1])
                    break
            out[name] = shape
        return out



__all__ = ["GptOssForCausalLM"]
