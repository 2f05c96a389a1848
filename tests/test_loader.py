"""Weight loading and the model registry, against a tiny fake model (the real models are tested
against transformers in their own files): every broken folder fails with a clear error before a
weight is read."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import types
from collections.abc import Iterable

import pytest
import torch
import transformers
from safetensors.torch import save_file

from workers import models as registry
from distengine.hf_config import ModelNotFoundError, load_hf_config, resolve_dtype, resolve_model_path, text_config
from workers.loader import (MissingShardError, MissingWeightsError, NoWeightsError, WeightShapeError,
                            get_weight_shapes, iterate_weights, load_model)


class TinyModel(torch.nn.Module):
    """The loader's contract in miniature: one Linear, weights sharded by rows over `tp`."""

    def __init__(self, config, tp, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config, self.tp = config, tp
        self.proj = torch.nn.Linear(config.hidden_size, config.intermediate_size, dtype=dtype, device=device)
        self.seen: list[str] = []

    def expected_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i = self.config.hidden_size, self.config.intermediate_size
        return {"model.proj.weight": (i, h), "model.proj.bias": (i,)}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        params = dict(self.named_parameters())
        for name, tensor in weights:
            self.seen.append(name)
            params[name.removeprefix("model.")].copy_(tensor)
            loaded.add(name)
        return loaded

    def missing_weights(self, loaded: set[str]) -> list[str]:
        return sorted(n for n in ("proj.weight", "proj.bias") if f"model.{n}" not in loaded)


HIDDEN, INTER = 8, 12


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.proj.weight": torch.randn(INTER, HIDDEN, generator=g),
            "model.proj.bias": torch.randn(INTER, generator=g),
            "vision.patch.weight": torch.randn(3, 3, generator=g)}  # a part the model does not take


def write_config(folder, **kw) -> None:
    transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, vocab_size=32,
                             architectures=["LlamaForCausalLM"], **kw).save_pretrained(folder)


def write_unsharded(folder, ts=None) -> None:
    write_config(folder)
    save_file(ts or tensors(), str(folder / "model.safetensors"))


def write_sharded(folder, ts=None) -> None:
    """Two shards and an index, as save_pretrained writes big models."""
    write_config(folder)
    ts = ts or tensors()
    shards = {"model-00001-of-00002.safetensors": ["model.proj.weight"],
              "model-00002-of-00002.safetensors": ["model.proj.bias", "vision.patch.weight"]}
    for file, names in shards.items():
        save_file({n: ts[n] for n in names}, str(folder / file))
    weight_map = {n: file for file, names in shards.items() for n in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


# --- resolving a model ----------------------------------------------------------------------


def test_local_folder_and_its_config_json(tmp_path):
    write_unsharded(tmp_path)
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()
    assert resolve_model_path(str(tmp_path / "config.json")) == tmp_path.resolve()


def test_local_folder_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope"))


def test_unreachable_hub_id_fails_fast_with_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import time
    start = time.monotonic()
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_path("org/does-not-exist")
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert "'org/does-not-exist'" in message and "neither a local folder" in message
    assert "HF_HUB_OFFLINE" in message and huggingface_hub.constants.HF_HUB_CACHE in message


def test_network_failure_falls_back_to_cache(monkeypatch, tmp_path):
    import huggingface_hub

    write_unsharded(tmp_path)
    calls = []

    def fake_snapshot(repo_id, revision=None, allow_patterns=None, local_files_only=False):
        calls.append((repo_id, revision, local_files_only))
        assert "*.safetensors" in allow_patterns and "tokenizer*" in allow_patterns
        if not local_files_only:
            raise OSError("Name or service not known")
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    assert resolve_model_path("org/cached", revision="main") == tmp_path
    assert calls == [("org/cached", "main", False), ("org/cached", "main", True)]


# --- config and dtype -----------------------------------------------------------------------


def test_config_and_dtype(tmp_path):
    write_config(tmp_path, dtype="bfloat16")
    config = load_hf_config(tmp_path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert resolve_dtype(config) == torch.bfloat16
    assert resolve_dtype(config, "float32") == torch.float32
    assert resolve_dtype(config, torch.float16) == torch.float16
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        resolve_dtype(config, "int8")
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        resolve_dtype(config, torch.int8)


def test_float32_checkpoint_is_bf16_on_cuda_only():
    config = transformers.LlamaConfig(dtype="float32")
    assert resolve_dtype(config, device="cpu") == torch.float32
    assert resolve_dtype(config, device="cuda") == torch.bfloat16
    assert resolve_dtype(transformers.LlamaConfig(), device="cpu") == torch.float32  # no dtype: float32


def test_multimodal_wrapper_dtype_and_text_config():
    config = transformers.Gemma3Config(text_config={"dtype": "bfloat16", "num_hidden_layers": 2})
    assert text_config(config).num_hidden_layers == 2
    assert resolve_dtype(config, device="cpu") == torch.bfloat16


# --- weights --------------------------------------------------------------------------------


@pytest.mark.parametrize("write", [write_unsharded, write_sharded])
def test_iterate_and_shapes(tmp_path, write):
    write(tmp_path)
    expected = tensors()
    got = dict(iterate_weights(tmp_path))
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0)
    assert get_weight_shapes(tmp_path) == {n: tuple(t.shape) for n, t in expected.items()}
    assert [n for n, _ in iterate_weights(tmp_path, names={"model.proj.bias"})] == ["model.proj.bias"]


def test_unsharded_files_sorted(tmp_path):
    save_file({"b": torch.zeros(1)}, str(tmp_path / "b.safetensors"))
    save_file({"a": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    assert [n for n, _ in iterate_weights(tmp_path)] == ["a", "b"]


def test_missing_shards_raise_before_anything_is_yielded(tmp_path):
    write_sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra"] = "model-00003-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingShardError) as err:
        iterate_weights(tmp_path)  # raised on the call, not on the first next()
    assert "model-00002-of-00002.safetensors" in str(err.value)
    assert "model-00003-of-00003.safetensors" in str(err.value)
    with pytest.raises(MissingShardError):
        get_weight_shapes(tmp_path)


def test_no_safetensors(tmp_path):
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(NoWeightsError, match=r"pytorch_model.bin.*not supported"):
        iterate_weights(tmp_path)


# --- load_model -----------------------------------------------------------------------------


@pytest.mark.parametrize("write", [write_unsharded, write_sharded])
def test_load_model(tmp_path, write):
    write(tmp_path)
    model = load_model(tmp_path, TinyModel, tp=None, dtype="auto", device="cpu")
    assert sorted(model.seen) == ["model.proj.bias", "model.proj.weight"]  # the vision part never read
    ts = tensors()
    torch.testing.assert_close(model.proj.weight, ts["model.proj.weight"], rtol=0, atol=0)
    torch.testing.assert_close(model.proj.bias, ts["model.proj.bias"], rtol=0, atol=0)
    assert model.proj.weight.dtype == torch.float32 and not model.training


def test_load_model_casts_to_requested_dtype(tmp_path):
    write_unsharded(tmp_path)
    model = load_model(tmp_path, TinyModel, tp=None, dtype="bfloat16", device="cpu")
    assert model.proj.weight.dtype == torch.bfloat16


def test_wrong_shape_raises_before_loading(tmp_path):
    ts = tensors()
    ts["model.proj.weight"] = torch.zeros(INTER, HIDDEN + 1)
    write_sharded(tmp_path, ts)
    built = []

    class Spy(TinyModel):
        def load_weights(self, weights):
            built.append(self)
            return super().load_weights(weights)

    with pytest.raises(WeightShapeError) as err:
        load_model(tmp_path, Spy, tp=None, device="cpu")
    assert "model.proj.weight: expected (12, 8), found (12, 9)" in str(err.value)
    assert not built


def test_missing_shard_raises_before_building(tmp_path):
    write_sharded(tmp_path)
    (tmp_path / "model-00001-of-00002.safetensors").unlink()

    class NeverBuilt(TinyModel):
        def __init__(self, *a, **kw):
            raise AssertionError("built despite a missing shard")

    with pytest.raises(MissingShardError, match="model-00001-of-00002"):
        load_model(tmp_path, NeverBuilt, tp=None, device="cpu")


def test_missing_weights(tmp_path):
    write_config(tmp_path)
    save_file({"model.proj.weight": tensors()["model.proj.weight"]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(MissingWeightsError, match="proj.bias"):
        load_model(tmp_path, TinyModel, tp=None, device="cpu")


# --- registry -------------------------------------------------------------------------------


def test_registry_imports_no_model_at_import_time():
    code = ("import sys, workers.models as m; "
            "assert not [k for k in sys.modules if k.startswith('workers.models.')], sys.modules.keys(); "
            "assert m.MODEL_REGISTRY['Gemma3ForConditionalGeneration'] == 'workers.models.gemma3:Gemma3ForCausalLM'; "
            "assert m.MODEL_REGISTRY['Llama4ForConditionalGeneration'] == 'workers.models.llama4:Llama4ForCausalLM'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registry_lazy_lookup(monkeypatch):
    module = types.ModuleType("fake_tiny_models")
    module.TinyModel = TinyModel
    monkeypatch.setitem(sys.modules, "fake_tiny_models", module)
    monkeypatch.setitem(registry.MODEL_REGISTRY, "TinyForCausalLM", "fake_tiny_models:TinyModel")
    assert registry.get_model_class(["SomethingElse", "TinyForCausalLM"]) is TinyModel


def test_unsupported_architecture():
    with pytest.raises(registry.UnsupportedArchitectureError) as err:
        registry.get_model_class(["MambaForCausalLM"])
    message = str(err.value)
    assert "MambaForCausalLM" in message and "LlamaForCausalLM" in message and "Cohere2ForCausalLM" in message
    with pytest.raises(registry.UnsupportedArchitectureError, match="no 'architectures'"):
        registry.get_model_class(None)
    assert issubclass(registry.UnsupportedArchitectureError, ValueError)
