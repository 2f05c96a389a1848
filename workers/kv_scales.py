"""An fp8 KV cache's per-layer scales, read from the checkpoint where it has them.

The names are those vLLM's loader accepts (`maybe_remap_kv_scale_name`, and compressed-tensors'
and Quark's `get_cache_scale`): `<attention>.k_scale` / `v_scale` (llm-compressor), ModelOpt's
`<attention>.k_proj.k_scale` / `v_proj.v_scale`, `<attention>.k_proj.output_scale` /
`v_proj.output_scale`, and the deprecated single `<attention>.kv_scale` (K's and V's). A layer
the checkpoint gives no scale keeps 1.0, as in vLLM. Scales are per tensor (one number a layer);
with the "auto" cache they are not read at all.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from workers.layers.attention import Attention

# (checkpoint name suffix, the scale(s) it gives), longer suffixes first.
KV_SCALE_SUFFIXES = ((".k_proj.k_scale", "k"), (".v_proj.v_scale", "v"),
                     (".k_proj.output_scale", "k"), (".v_proj.output_scale", "v"),
                     (".k_scale", "k"), (".v_scale", "v"), (".kv_scale", "kv"))


def kv_scale_names(checkpoint_names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Checkpoint tensor name -> (its attention block's checkpoint prefix, "k", "v" or "kv")."""
    out = {}
    for name in checkpoint_names:
        for suffix, which in KV_SCALE_SUFFIXES:
            if name.endswith(suffix):
                out[name] = (name[: -len(suffix)], which)
                break
    return out


def _attention_of(model: nn.Module, block: str, scale_name: str) -> Attention:
    """Our Attention of a checkpoint attention block: the module holding the parameter its
    k_proj weight loads into (the model's own name mapping, whatever prefixes it renames)."""
    param, _ = model.checkpoint_to_param(f"{block}.k_proj.weight")
    path = param.rsplit(".", 2)[0]  # <attention>.qkv_proj.weight -> <attention>
    try:
        attn = getattr(model.get_submodule(path), "attn", None)
    except AttributeError:
        attn = None
    if not isinstance(attn, Attention):
        raise ValueError(f"checkpoint tensor {scale_name}: no attention layer of {type(model).__name__} "
                         f"takes it (looked for {path}.attn)")
    return attn


def load_kv_scales(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]],
                   names: dict[str, tuple[str, str]]) -> int:
    """Sets each attention layer's (k, v) scales from the checkpoint's `tensors` (`names` as
    `kv_scale_names` gives them); returns the layers that got one."""
    found: dict[Attention, dict[str, float]] = {}
    for name, t in tensors:
        block, which = names[name]
        if t.numel() != 1:
            raise ValueError(f"checkpoint tensor {name}: a KV cache scale of shape {tuple(t.shape)}; only "
                             f"per-tensor scales (one number a layer) are supported")
        value = float(t.float().item())
        got = found.setdefault(_attention_of(model, block, name), {})
        for part in which:
            got[part] = value
    for attn, got in found.items():
        attn.set_kv_scales(got.get("k", 1.0), got.get("v", 1.0))
    return len(found)
