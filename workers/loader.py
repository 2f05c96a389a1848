"""Loading a Hugging Face model into one tensor-parallel rank.

Everything that can be wrong with a model folder (unknown id, missing shard, tensor of the wrong
shape, parameter with no weight) is found here and raised as a ValueError subclass naming the
culprit, before the engine runs a step. Weights are read from safetensors one tensor at a time, so
no rank and no host ever holds a full copy of the model: the model shards each tensor as it comes.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Collection, Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from kernels.fp8 import FP8_DTYPE, FP8_MAX
from workers.layers.linear import quantized_linears

if TYPE_CHECKING:
    from workers.parallel import TPGroup

from distengine.config_snapshot import ConfigSnapshot, snapshot
from distengine.hf_config import load_hf_config, resolve_dtype, resolve_model_path
from distengine.quantization import QuantizationConfig, resolve_quantization
from distengine.model_config import FP8_KV_CACHE_DTYPES
from workers.kv_scales import kv_scale_names, load_kv_scales

INDEX_FILE = "model.safetensors.index.json"


class MissingShardError(ValueError):
    """The index names shard files the folder lacks (an interrupted download, usually)."""


class NoWeightsError(ValueError):
    """The folder has no safetensors weights (we read no .bin/.pt pickles)."""


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the model (built from config.json) expects."""


class MissingWeightsError(ValueError):
    """Model parameters that no checkpoint tensor filled: they would hold garbage."""


class WeightDtypeError(ValueError):
    """A checkpoint tensor stored in FP8 where the model holds it in its own dtype, or the
    reverse: the quantization_config does not describe the weights."""


class LoadableModel(Protocol):
    """What `load_model` needs from a model class beyond `torch.nn.Module`."""

    def expected_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def missing_weights(self, loaded: set[str]) -> list[str]: ...


# ---------------------------------------------------------------------------------------------
# Weights


def _weight_files(path: str | os.PathLike) -> dict[pathlib.Path, list[str] | None]:
    """Each safetensors file to read and, with an index, the tensor names to take from it
    (None: all of them). Raises if a shard is missing or there is nothing to read, so that a
    broken folder fails before a single tensor is loaded."""
    folder = pathlib.Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        return _indexed_files(folder, index)
    files = sorted(folder.glob("*.safetensors"))
    # Mistral repos ship their native consolidated*.safetensors beside the HF files (other names).
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    files = hf_files or files
    if not files:
        pickles = sorted(p.name for p in [*folder.glob("*.bin"), *folder.glob("*.pt")])
        found = f"found {', '.join(pickles[:3])}, but " if pickles else ""
        raise NoWeightsError(f"no *.safetensors weights in {folder} ({found}.bin/.pt checkpoints are not "
                             f"supported: convert them to safetensors)")
    return {f: None for f in files}


def _indexed_files(folder: pathlib.Path, index: pathlib.Path) -> dict[pathlib.Path, list[str] | None]:
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    files: dict[pathlib.Path, list[str] | None] = {}
    for name, file in weight_map.items():
        names = files.setdefault(folder / file, [])
        assert names is not None
        names.append(name)
    missing = sorted(f.name for f in files if not f.is_file())
    if missing:
        raise MissingShardError(f"{folder}: {len(missing)} of the {len(files)} shard files named in "
                                f"{INDEX_FILE} are missing: {', '.join(missing)} (an incomplete download?)")
    return dict(sorted(files.items()))


def iterate_weights(path: str | os.PathLike,
                    names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor in the checkpoint's dtype), one tensor in memory at a time.

    The folder is checked when this is called, not when iteration starts, so a missing shard is
    raised before anything is yielded. `names` restricts the tensors read: the others (say a
    vision tower we do not serve) are never loaded.
    """
    return _read_tensors(_weight_files(path), names)


def _read_tensors(files: dict[pathlib.Path, list[str] | None],
                  wanted: Collection[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file, listed in files.items():
        with safe_open(str(file), "pt") as f:
            for name in listed if listed is not None else f.keys():
                if wanted is None or name in wanted:
                    yield name, f.get_tensor(name)


def get_weight_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's shape, from the safetensors headers alone (no data read), so
    that shapes are checked against the model before any memory is spent on weights."""
    return {name: shape for name, (shape, _) in get_weight_headers(path).items()}


def get_weight_headers(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every checkpoint tensor's (shape, safetensors dtype name such as "BF16" or "F8_E4M3"),
    from the headers alone."""
    from safetensors import safe_open

    headers: dict[str, tuple[tuple[int, ...], str]] = {}
    for file, listed in _weight_files(path).items():
        with safe_open(str(file), "pt") as f:
            present = set(f.keys())
            absent = [n for n in listed or () if n not in present]
            if absent:
                raise MissingShardError(f"{file.name} lacks {len(absent)} tensors that {INDEX_FILE} places "
                                        f"there: {_some(absent)}")
            for name in listed if listed is not None else f.keys():
                sl = f.get_slice(name)
                headers[name] = (tuple(sl.get_shape()), sl.get_dtype())
    return headers


def _some(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


# ---------------------------------------------------------------------------------------------
# The model


def check_weight_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]]) -> None:
    """Raise WeightShapeError listing every checkpoint tensor the model takes whose full
    (unsharded) shape differs from the model's: a config that does not match its weights."""
    # (A one-element shape matches another: per-tensor scales are saved as [] or [1].)
    wrong = [f"{name}: expected {tuple(expected[name])}, found {tuple(found[name])}"
             for name in sorted(expected.keys() & found.keys())
             if tuple(expected[name]) != tuple(found[name])
             and not (math.prod(expected[name]) == 1 == math.prod(found[name]))]
    if wrong:
        raise WeightShapeError(f"{len(wrong)} checkpoint tensors do not have the shape the config implies: "
                               f"{_some(wrong)}")


def check_weight_dtypes(expected: Collection[str], found: dict[str, str],
                        quant: QuantizationConfig | None) -> None:
    """Raise WeightDtypeError unless exactly the weights the model holds in FP8 (those beside
    which it expects a scale tensor) are stored in FP8 (float8_e4m3fn): an FP8 embedding, head,
    router or Mamba-1 projection, say, is refused by name before any data is read."""
    scale = quant.scale_name if quant is not None else None
    ours = {n for n in expected if scale and n.endswith(".weight") and f"{n[:-len('weight')]}{scale}" in expected}
    wrong = []
    for name in sorted(set(expected) & found.keys()):
        fp8 = found[name].startswith("F8")
        if name in ours and found[name] != "F8_E4M3":
            wrong.append(f"{name} is stored as {found[name]}, but the quantization_config makes it FP8 (F8_E4M3)")
        elif fp8 and name not in ours:
            wrong.append(f"{name} is stored in FP8 ({found[name]}) but is not served in FP8 (FP8 weights are "
                         f"served for the linear layers that the quantization_config quantizes, and Qwen3-Next / "
                         f"Qwen3.5-MoE experts; not embeddings, heads, routers, other families' experts, Mamba "
                         f"input projections or the Gated DeltaNet's b / a projections)")
    if wrong:
        raise WeightDtypeError(f"{len(wrong)} checkpoint tensors have a dtype the model does not take: {_some(wrong)}")


def model_config(path: str | os.PathLike, hf_config: ConfigSnapshot | None = None) -> ConfigSnapshot:
    """What a model is built from: the engine's snapshot of its config, else its config.json read
    here (which imports transformers)."""
    return hf_config if hf_config is not None else snapshot(load_hf_config(path))


def load_model(path: str | os.PathLike, model_cls: type, tp: TPGroup,
               dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu",
               max_model_len: int | None = None, kv_cache_dtype: str = "auto",
               quantization: str | None = None, hf_config: ConfigSnapshot | None = None) -> torch.nn.Module:
    """Build `model_cls` (an nn.Module following `LoadableModel`) for this rank and fill it from
    the checkpoint at `path`.

    The model receives the full HF config (a multimodal wrapper's too: its weight names depend on
    it; `text_config(config)` is the language part). Missing shards and wrong shapes are raised
    before any tensor data is read; only the tensors named by `expected_checkpoint_shapes()` are
    read and handed to `load_weights`, which shards each one itself. `max_model_len` sizes the
    rotary caches (default: the config's max_position_embeddings). The checkpoint's
    quantization_config (`distengine.quantization`) says which linear layers hold FP8 weights;
    the headers' dtypes must agree. With an fp8 `kv_cache_dtype` the checkpoint's KV cache scales
    are read too (`workers.kv_scales`). `hf_config`: the model's config as the engine read it
    (None: read from `path`).
    """
    config = model_config(path, hf_config)
    device = torch.device(device)
    resolved = resolve_dtype(config, dtype, device)
    quant = resolve_quantization(config.to_dict(), quantization, "auto")
    headers = get_weight_headers(path)
    extra = {"max_positions": max_model_len} if max_model_len else {}
    with quantized_linears(quant):
        model = model_cls(config, tp=tp, dtype=resolved, device=device, **extra)
    expected = model.expected_checkpoint_shapes()
    check_weight_shapes(expected, {name: shape for name, (shape, _) in headers.items()})
    check_weight_dtypes(expected, {name: dt for name, (_, dt) in headers.items()}, quant)
    with torch.no_grad():
        loaded = model.load_weights(iterate_weights(path, names=expected.keys()))
    missing = model.missing_weights(set(loaded))
    if missing:
        raise MissingWeightsError(f"{len(missing)} model parameters got no weight from {path}: {_some(missing)}")
    # (a tensor the model itself takes is a weight, whatever its name)
    scales = kv_scale_names(set(headers) - set(expected)) if kv_cache_dtype in FP8_KV_CACHE_DTYPES else {}
    if scales:
        load_kv_scales(model, iterate_weights(path, names=scales.keys()), scales)
    return model.eval()


def get_model(model: str, tp: TPGroup, dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu",
              revision: str | None = None, max_model_len: int | None = None,
              load_format: str = "auto", seed: int = 0, kv_cache_dtype: str = "auto",
              quantization: str | None = None, hf_config: ConfigSnapshot | None = None) -> torch.nn.Module:
    """The whole path from an id or folder to a loaded rank shard, in the order that fails
    cheapest first (id, then architecture, then shards and shapes, then data). `load_format`
    "dummy" (vLLM's name) reads no weights: the folder needs only its config.json, and the
    weights are random (uniform in +-1e-3, as vLLM's), for benchmarks; with `quantization`
    "fp8" the linear layers' weights are FP8 in 128 x 128 blocks with random scales ("modelopt":
    per-tensor scales, one a row). A module that
    keeps weights in another format (MXFP4 experts) fills them itself through its `dummy_weights`."""
    from workers.models import get_model_class

    path = resolve_model_path(model, revision)
    hf_config = model_config(path, hf_config)
    model_cls = get_model_class(getattr(hf_config, "architectures", None))
    if load_format == "dummy":
        return dummy_model(path, model_cls, tp, dtype, device, max_model_len, seed, quantization, hf_config)
    return load_model(path, model_cls, tp, dtype, device, max_model_len, kv_cache_dtype, quantization, hf_config)


def dummy_model(path: str | os.PathLike, model_cls: type, tp: TPGroup, dtype: str | torch.dtype = "auto",
                device: torch.device | str = "cpu", max_model_len: int | None = None, seed: int = 0,
                quantization: str | None = None, hf_config: ConfigSnapshot | None = None) -> torch.nn.Module:
    config = model_config(path, hf_config)
    device = torch.device(device)
    extra = {"max_positions": max_model_len} if max_model_len else {}
    with quantized_linears(resolve_quantization(config.to_dict(), quantization, "dummy")):
        model = model_cls(config, tp=tp, dtype=resolve_dtype(config, dtype, device), device=device, **extra)
    gen = torch.Generator(device).manual_seed(seed + tp.rank)
    scales = {id(m.fp8_scale) for m in model.modules() if getattr(m, "fp8", None) is not None}
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == FP8_DTYPE:  # FP8 values over their whole range, scaled back to +-1e-3
                for rows in p.split(4096):
                    rows.copy_(torch.empty(rows.shape, device=device).uniform_(-FP8_MAX, FP8_MAX, generator=gen))
            elif id(p) in scales:
                p.uniform_(0.5e-3 / FP8_MAX, 1.5e-3 / FP8_MAX, generator=gen)
            elif p.is_floating_point():
                p.uniform_(-1e-3, 1e-3, generator=gen)
        for m in model.modules():
            if hasattr(m, "dummy_weights"):
                m.dummy_weights(gen)
    return model.eval()
