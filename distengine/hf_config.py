"""Finding a Hugging Face model and reading its config.json, on whichever side needs it: the
driver (the engine's config, the KV cache plan, the tokenizer's EOS ids) and each worker (the
model's shapes, the weights' folder). A hub id resolves to a local snapshot, downloaded or from
the cache."""
from __future__ import annotations

import functools
import os
import pathlib
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from distengine.config import EngineConfig

ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "tokenizer*"]
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class ModelNotFoundError(ValueError):
    """The model is neither a local folder, nor on a reachable hub, nor in the HF cache."""


# ---------------------------------------------------------------------------------------------
# Resolving a model id


def resolve_model_path(model: str, revision: str | None = None) -> pathlib.Path:
    """The local folder holding `model`'s config.json: `model` itself when it is a folder,
    otherwise a hub snapshot (downloaded, or from the HF cache when the hub cannot be reached)."""
    local = pathlib.Path(model).expanduser()
    if local.is_file() and local.name == "config.json":
        local = local.parent
    if local.is_dir():
        return _checked_folder(local.resolve(), model)
    if _looks_like_path(model):
        raise ModelNotFoundError(f"model folder {model!r} does not exist")
    return _checked_folder(_snapshot(model, revision), model)


def _looks_like_path(model: str) -> bool:
    """A hub id is "name" or "org/name"; anything else can only have meant a local folder."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def _checked_folder(folder: pathlib.Path, model: str) -> pathlib.Path:
    if not (folder / "config.json").is_file():
        raise ModelNotFoundError(f"model {model!r}: folder {folder} holds no config.json")
    return folder


def _snapshot(repo_id: str, revision: str | None) -> pathlib.Path:
    """Hub first, then the cache: a machine without network can still serve a cached model."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HFValidationError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    def download(local_files_only: bool) -> pathlib.Path:
        return pathlib.Path(huggingface_hub.snapshot_download(
            repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=local_files_only))

    try:
        return download(local_files_only=False)
    except HFValidationError as e:
        raise ModelNotFoundError(f"model {_model_label(repo_id, revision)} is neither a local folder "
                                 f"nor a valid Hugging Face hub id: {e}") from e
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as e:
        # The hub answered: retrying the cache would only hide its reason.
        raise ModelNotFoundError(f"model {_model_label(repo_id, revision)} is not a local folder and the "
                                 f"Hugging Face hub refused it ({type(e).__name__}; a private or gated "
                                 f"repo needs HF_TOKEN): {_first_line(e)}") from e
    except Exception as online_error:  # noqa: BLE001 - network failures come in many types
        try:
            return download(local_files_only=True)
        except Exception as cache_error:  # noqa: BLE001
            raise ModelNotFoundError(
                f"model {_model_label(repo_id, revision)} is neither a local folder, nor reachable on the "
                f"Hugging Face hub ({type(online_error).__name__}: {_first_line(online_error)}), nor cached "
                f"in {constants.HF_HUB_CACHE} (HF_HUB_CACHE / HF_HOME choose it). Pass a local folder, "
                f"or download it where there is network and copy the cache here; HF_HUB_OFFLINE=1 "
                f"skips the network and uses the cache only"
                f"{' (it is set)' if constants.HF_HUB_OFFLINE else ''}") from cache_error


def _model_label(repo_id: str, revision: str | None) -> str:
    return repr(repo_id) if revision is None else f"{repo_id!r} (revision {revision!r})"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"


# ---------------------------------------------------------------------------------------------
# Config and dtype


def load_hf_config(path: str | os.PathLike) -> PretrainedConfig:
    """The full config (with `architectures`, which picks our class); the text part of a
    multimodal wrapper is `text_config(config)`."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path))


def read_model_config(model: str) -> PretrainedConfig:
    """`model`'s config.json as the driver reads it: found (a folder, the hub, its cache) and parsed
    once per process while the file stays as it is. Shared: read it, never change it."""
    path = resolve_model_path(model)
    return _parsed_config(str(path), (path / "config.json").stat().st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _parsed_config(path: str, mtime_ns: int) -> PretrainedConfig:
    return load_hf_config(path)


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The language model's config: itself for a text model, `text_config` for Gemma-3 or Llama-4
    multimodal wrappers, whose layer counts, heads and windows live there."""
    return config.get_text_config()


def resolve_dtype(config: PretrainedConfig, dtype: str | torch.dtype = "auto",
                  device: torch.device | str | None = None) -> torch.dtype:
    """The dtype the model's parameters will have.

    "auto" takes the checkpoint's dtype from the config (`dtype`, formerly `torch_dtype`, on the
    wrapper or its text config), except that a float32 checkpoint is served as bfloat16 on CUDA
    (float32 would double the memory and run off the tensor cores' fast path) and kept float32 on
    CPU (CPU bf16 matmuls are slow and less exact, and the CPU tests compare against float32
    transformers). A config without a dtype is a float32 checkpoint (transformers' default).
    `device` defaults to CUDA when one is available.
    """
    if isinstance(dtype, torch.dtype):
        return _checked_dtype(dtype, "dtype")
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    found = _config_dtype(config)
    if found == torch.float32 and _device_type(device) == "cuda":
        return torch.bfloat16
    return found


def dtype_name(dtype: torch.dtype) -> str:
    """The name `resolve_dtype` takes for it (a config travels to the workers as plain data)."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def _checked_dtype(dtype: torch.dtype, where: str) -> torch.dtype:
    if dtype not in DTYPES.values():
        raise ValueError(f"unsupported {where} {dtype}; choose one of: auto, {', '.join(DTYPES)}")
    return dtype


def _config_dtype(config: PretrainedConfig) -> torch.dtype:
    for cfg in (config, text_config(config)):
        value = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
        if value is not None:
            if isinstance(value, str):
                value = DTYPES.get(value.removeprefix("torch."), value)
            if not isinstance(value, torch.dtype):
                raise ValueError(f"config.json has dtype {value!r}, which we do not serve; pass dtype= "
                                 f"one of: {', '.join(DTYPES)}")
            return _checked_dtype(value, "config.json dtype (pass dtype= explicitly)")
    return torch.float32


def _device_type(device: torch.device | str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


# ---------------------------------------------------------------------------------------------
# The tokenizer and the end of a request


def load_tokenizer_and_eos(config: EngineConfig) -> tuple[object | None, frozenset[int]]:
    """The driver's own copy: the tokenizer (None when the model ships none) and the ids that end
    a request (the generation config's, else the model config's)."""
    path = resolve_model_path(config.model)
    return load_tokenizer(config.tokenizer or str(path)), eos_token_ids(path, text_config(read_model_config(config.model)))


def load_tokenizer(path: str):
    """The model's tokenizer, or None when it ships none (prompts must then be token ids).
    Only tokenizer files count: transformers may otherwise build an empty one."""
    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in files):
        return None
    try:
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None


def eos_token_ids(path: str | os.PathLike, config: PretrainedConfig) -> frozenset[int]:
    """The ids that end a request: the generation config's, else the model config's."""
    ids = getattr(config, "eos_token_id", None)
    try:
        from transformers import GenerationConfig
        ids = GenerationConfig.from_pretrained(path).eos_token_id or ids
    except (OSError, ValueError):
        pass
    if ids is None:
        return frozenset()
    return frozenset(ids if isinstance(ids, (list, tuple)) else [ids])
