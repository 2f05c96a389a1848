"""What every decoder model shares: checkpoint-name mapping onto fused parameters, the expected
full shapes (checked before any data is read), and per-parameter loading."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from workers.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

# (our fused parameter, checkpoint name part, shard)
STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]


# A multimodal checkpoint's prefixes of its language model -> ours (transformers 5's and 4's layouts).
TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                 ("language_model.lm_head.", "lm_head."))


def text_name(name: str) -> str:
    """Our (text-model) name of a checkpoint tensor name, either layout."""
    for theirs, ours in TEXT_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs):]
    return name


def multimodal_shapes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A text model's expected shapes under every multimodal layout's names (a multimodal config
    does not say which layout its checkpoint uses: the loader reads the names the checkpoint has,
    and `text_name` maps them back)."""
    out = {}
    for name, shape in shapes.items():
        if name.startswith("lm_head."):  # transformers 5 keeps the wrapper's head at the top
            out[name] = shape
        for theirs, ours in TEXT_PREFIXES:
            if name.startswith(ours):
                out[theirs + name[len(ours):]] = shape
    return out


def rope_params(config, layer_type: str = "full_attention") -> tuple[float, dict | None]:
    """(base, scaling dict) of a layer type, from transformers 5's `rope_parameters` (nested per
    layer type for Gemma-3) or the older `rope_theta` / `rope_scaling` / `rope_local_base_freq`."""
    rp = getattr(config, "rope_parameters", None)
    if rp:
        if layer_type in rp and isinstance(rp[layer_type], dict):
            rp = rp[layer_type]
        elif "rope_theta" not in rp and "full_attention" in rp:
            rp = rp["full_attention"]
        scaling = rp if rp.get("rope_type", "default") != "default" else None
        return float(rp.get("rope_theta", 10000.0)), scaling
    if layer_type == "sliding_attention" and getattr(config, "rope_local_base_freq", None):
        return float(config.rope_local_base_freq), None
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)


def _owner(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0]) if "." in param_name else model


class DecoderForCausalLM(nn.Module):
    """Subclasses build `self.model` (embed_tokens, layers, norm) and `self.lm_head`."""

    tie_word_embeddings = False
    # The checkpoint parts this model fuses into one parameter (a model whose MLP keeps an
    # unfused up_proj, say, fuses fewer).
    stacked = STACKED
    # Checkpoint name prefixes that hold no weight of ours (vision towers and the like).
    ignored_prefixes: tuple[str, ...] = ()

    def checkpoint_to_param(self, name: str) -> tuple[str, object]:
        """Our parameter name and shard for a checkpoint tensor name."""
        for fused, part, shard in self.stacked:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

    def expected_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for path, module in self.named_modules():
            if isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
                for fused, part, shard in self.stacked:
                    if path.endswith(fused):
                        if module.part_shapes(shard) is None:  # a part this layer lacks
                            continue
                        for pname, shape in module.part_shapes(shard).items():
                            shapes[f"{path[: -len(fused)]}{part}.{pname}"] = shape
                continue
            full = getattr(module, "full_shapes", None)
            if full is not None:
                for pname, shape in full().items():
                    shapes[f"{path}.{pname}"] = shape
                continue
            for pname, p in module.named_parameters(recurse=False):
                shapes[f"{path}.{pname}" if path else pname] = tuple(p.shape)
        if self.tie_word_embeddings:
            shapes.pop("lm_head.weight", None)
        return shapes

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            if ckpt_name.startswith(self.ignored_prefixes) or "rotary_emb.inv_freq" in ckpt_name:
                continue
            name, shard = self.checkpoint_to_param(ckpt_name)
            if self.tie_word_embeddings and name == "lm_head.weight":  # (after any renaming)
                loaded.add(ckpt_name)
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {ckpt_name} has no place in {type(self).__name__}")
            loader = getattr(_owner(self, name), "weight_loader", None)
            if loader is None:
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"{ckpt_name}: checkpoint tensor has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(param.shape)}")
                param.data.copy_(tensor)
            else:
                loader(param, tensor.to(param.dtype), shard)
            loaded.add(ckpt_name)
        return loaded

    def missing_weights(self, loaded: set[str]) -> list[str]:
        return sorted(set(self.expected_checkpoint_shapes()) - loaded)

    def cache_layers(self) -> dict[str, nn.Module]:
        """Plan layer name ("model.layers.i") -> the module that keeps its cache (an Attention;
        hybrid models add their Mamba mixers)."""
        return {f"model.layers.{i}": layer.self_attn.attn for i, layer in enumerate(self.model.layers)}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)
