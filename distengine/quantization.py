"""A checkpoint's `quantization_config`, read in one place and refused by name when we do not
serve it, before any weight is read (`EngineConfig.create` calls it on the driver).

Served: FP8 weights (float8_e4m3fn, one byte an element) of the linear layers, in the two
published layouts, and their scales:
- quant_method "fp8" (transformers' FineGrainedFP8, Qwen's and DeepSeek's checkpoints): with
  `weight_block_size` [bn, bk] a float32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] per linear
  (W = weight * scale over each bn x bk block, despite the name); without it, vLLM's per-tensor
  variant: a scalar `weight_scale`. Modules in `modules_to_not_convert` / `ignored_layers` (a
  substring of the name, as transformers and vLLM match them) stay unquantized.
- quant_method "compressed-tensors" (llm-compressor), format "float-quantized" or
  "naive-quantized": 8-bit float weights of strategy "tensor" (`weight_scale` [1]), "channel"
  ([N, 1]) or "block" (`block_structure` [bn, bk]: [ceil(N/bn), ceil(K/bk)]); `targets` "Linear"
  or "re:" patterns, `ignore` exact names or "re:" patterns.
- quant_method "modelopt" (NVIDIA's TensorRT Model Optimizer: NVIDIA's own FP8 checkpoints, such
  as Nemotron-3-Nano-30B-A3B-FP8), quant_algo "FP8": a scalar `weight_scale` per linear (and per
  expert projection); `ignore` (config.json) or `exclude_modules` (its older nested
  `quantization` form) as ModelOpt writes them, shell wildcards ("backbone.layers.4.mixer*": the
  module and everything under it, not layers 40-49).
Activations stay in the model's dtype (weight-only FP8, as vLLM's W8A16 fallback): a static
`input_scale` is not read. "mxfp4" is gpt-oss's own format: that model class decides on it.
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

FP8, COMPRESSED_TENSORS, MODELOPT = "fp8", "compressed-tensors", "modelopt"
TENSOR, CHANNEL, BLOCK = "tensor", "channel", "block"
# `--quantization` values (vLLM's option): "fp8" asks for FP8 linear weights (a dummy load: in
# 128 x 128 blocks), "modelopt" for a ModelOpt checkpoint's (a dummy load: per-tensor scales).
QUANTIZATION_OPTIONS = (None, FP8, MODELOPT)
QUANTIZATION_CHOICES = [q for q in QUANTIZATION_OPTIONS if q]  # the command lines' choices
MODELOPT_ALGOS = ("FP8",)
# What a dummy load with `--quantization fp8` stores: the published block-wise layout.
DUMMY_BLOCK = (128, 128)
# The multimodal / hybrid prefixes a checkpoint may put before our text model's "model." names.
_CHECKPOINT_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "backbone.")


@dataclass(frozen=True)
class QuantizationConfig:
    method: str                          # FP8, COMPRESSED_TENSORS or MODELOPT
    strategy: str                        # TENSOR, CHANNEL or BLOCK: how weight scales are laid out
    block_size: tuple[int, int] | None   # (bn, bk) for BLOCK
    scale_name: str                      # the scale tensor beside each `weight`
    ignore: tuple[str, ...] = ()         # modules left in the model's dtype
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors' targets ("Linear": every linear)

    def quantizes(self, name: str) -> bool:
        """Whether the checkpoint stores linear module `name` (our spelling, "model.layers.0...")
        in FP8; its multimodal / hybrid spellings are matched too."""
        names = _spellings(name)
        if self.method == FP8:  # transformers' and vLLM's rule: a listed name anywhere in the module's
            return not any(entry in n for entry in self.ignore for n in names)
        if self.method == MODELOPT:
            return not any(_wildcard(entry, n) for entry in self.ignore for n in names)
        targeted = any(t == "Linear" or _matches(t, n) for t in self.targets for n in names)
        return targeted and not any(_matches(entry, n) for entry in self.ignore for n in names)


def _spellings(name: str) -> list[str]:
    if not name.startswith("model."):
        return [name]
    rest = name[len("model."):]
    return [p + rest for p in _CHECKPOINT_PREFIXES]


def _matches(entry: str, name: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == name


def _wildcard(pattern: str, name: str) -> bool:
    """ModelOpt's exclusion: a shell pattern, where a trailing "*" after a name's own character
    means that module and the modules under it (vLLM's reading, so that "layers.4*" does not
    exclude layer 40)."""
    if pattern.endswith("*") and not pattern.endswith(".*") and len(pattern) > 1:
        stem = pattern[:-1]
        return fnmatch.fnmatchcase(name, stem) or fnmatch.fnmatchcase(name, stem + ".*")
    return fnmatch.fnmatchcase(name, pattern)


def _get(quant, key: str, default=None):
    return quant.get(key, default) if isinstance(quant, dict) else getattr(quant, key, default)


def quantization_dict(hf_config: dict) -> dict | None:
    """The `quantization_config` of a config dict, at the top or in its text config."""
    for cfg in (hf_config, hf_config.get("text_config") or {}):
        quant = cfg.get("quantization_config")
        if quant:
            return quant if isinstance(quant, dict) else quant.to_dict()
    return None


def read_quantization_config(hf_config: dict) -> QuantizationConfig | None:
    """The served quantization of a config dict; None for an unquantized model (or gpt-oss's
    "mxfp4", which the gpt-oss model class judges). Anything else raises ValueError naming it."""
    quant = quantization_dict(hf_config)
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == "mxfp4" and "GptOssForCausalLM" in (hf_config.get("architectures") or []):
        return None
    if method == FP8:
        return _fp8(quant)
    if method == COMPRESSED_TENSORS:
        return _compressed_tensors(quant)
    if method == MODELOPT:
        return _modelopt(quant)
    raise ValueError(f"{method!r}-quantized checkpoints are not supported (served: FP8 weights, quant_method "
                     f"'fp8', 'compressed-tensors' float-quantized or 'modelopt' FP8)")


def _fp8(quant: dict) -> QuantizationConfig:
    if quant.get("modules_to_convert"):
        raise ValueError(f"fp8 checkpoint: quantized {quant['modules_to_convert']} (modules_to_convert: FP8 "
                         f"embeddings or heads) are not supported")
    if quant.get("expert_dtype", FP8) != FP8:
        raise ValueError(f"fp8 checkpoint: experts in {quant['expert_dtype']!r} are not supported")
    if quant.get("scale_fmt", "float") != "float":
        raise ValueError(f"fp8 checkpoint: scale_fmt {quant['scale_fmt']!r} is not supported (only 'float')")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8 checkpoint: fmt {quant['fmt']!r} is not supported (only 'e4m3')")
    ignore = tuple(quant.get("modules_to_not_convert") or ()) + tuple(quant.get("ignored_layers") or ())
    block = quant.get("weight_block_size")
    if block is None:
        return QuantizationConfig(FP8, TENSOR, None, "weight_scale", ignore)
    return QuantizationConfig(FP8, BLOCK, _block(block, "weight_block_size"), "weight_scale_inv", ignore)


def _block(block, what: str) -> tuple[int, int]:
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{what} must be two positive ints [rows, columns], got {block!r}")
    return int(block[0]), int(block[1])


def _compressed_tensors(quant: dict) -> QuantizationConfig:
    groups = quant.get("config_groups") or {}
    if not groups:
        raise ValueError("compressed-tensors checkpoint without config_groups: nothing says how weights are stored")
    schemes, targets = set(), []
    for name, group in groups.items():
        fmt = group.get("format") or quant.get("format")
        if fmt not in ("float-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors format {fmt!r} (group {name}) is not supported (served: "
                             f"'float-quantized', 'naive-quantized' FP8 weights)")
        w = group.get("weights") or {}
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors weights of {w.get('num_bits')}-bit {w.get('type')!r} (group {name}) "
                             f"are not supported (served: 8-bit float)")
        strategy = w.get("strategy")
        if strategy not in (TENSOR, CHANNEL, BLOCK):
            raise ValueError(f"compressed-tensors weight strategy {strategy!r} (group {name}) is not supported "
                             f"(served: 'tensor', 'channel', 'block')")
        if w.get("dynamic"):
            raise ValueError(f"compressed-tensors dynamic weight scales (group {name}) are not supported")
        if w.get("symmetric") is False:
            raise ValueError(f"compressed-tensors asymmetric weights (zero points, group {name}) are not supported")
        block = _block(w.get("block_structure"), "block_structure") if strategy == BLOCK else None
        schemes.add((strategy, block))
        targets += list(group.get("targets") or ())
    if len(schemes) > 1:
        raise ValueError(f"compressed-tensors checkpoint with several weight schemes ({sorted(map(str, schemes))}) "
                         f"is not supported (one per checkpoint)")
    strategy, block = schemes.pop()
    return QuantizationConfig(COMPRESSED_TENSORS, strategy, block, "weight_scale", tuple(quant.get("ignore") or ()),
                              tuple(targets))


def _modelopt(quant: dict) -> QuantizationConfig | None:
    nested = quant.get("quantization")  # the hf_quant_config.json form, kept by some exports
    if isinstance(nested, dict):
        quant = {**nested, "ignore": nested.get("exclude_modules") or []}
    algo = str(quant.get("quant_algo") or "").upper()
    if not algo and (quant.get("kv_cache_scheme") or quant.get("kv_cache_quant_algo")):
        return None  # KV cache scales alone: the weights are in the model's dtype
    if algo not in MODELOPT_ALGOS:
        raise ValueError(f"modelopt checkpoint with quant_algo {quant.get('quant_algo')!r}: not supported (served: "
                         f"{', '.join(MODELOPT_ALGOS)}: FP8 weights with per-tensor scales)")
    ignore = quant.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ValueError(f"modelopt checkpoint: ignore / exclude_modules must be a list of module patterns, "
                         f"got {ignore!r}")
    return QuantizationConfig(MODELOPT, TENSOR, None, "weight_scale", tuple(ignore))


def resolve_quantization(hf_config: dict, quantization: str | None, load_format: str) -> QuantizationConfig | None:
    """What the workers build: the checkpoint's quantization, or with `load_format` "dummy" and
    `quantization` "fp8" random FP8 weights in the block-wise layout ("modelopt": per-tensor
    scales, as NVIDIA publishes them). Refusals raise ValueError."""
    if quantization not in QUANTIZATION_OPTIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATION_OPTIONS}, got {quantization!r}")
    found = read_quantization_config(hf_config)
    if quantization is None:
        return found
    if load_format == "dummy":
        if found:
            return found
        if quantization == MODELOPT:
            return QuantizationConfig(MODELOPT, TENSOR, None, "weight_scale")
        return QuantizationConfig(FP8, BLOCK, DUMMY_BLOCK, "weight_scale_inv")
    if found is None:
        raise ValueError(f"quantization={quantization!r} with an unquantized checkpoint: quantizing weights while "
                         f"loading is not supported; use an FP8 checkpoint (or load_format='dummy')")
    if found.method != quantization:
        raise ValueError(f"quantization={quantization!r} but the checkpoint is {found.method!r}-quantized: leave "
                         f"quantization unset to use the checkpoint's")
    return found
