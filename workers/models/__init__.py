"""Model registry: the `architectures` field of a Hugging Face config.json names our implementation.

Entries are "module:Class" strings imported on first use, so that importing the registry (the
scheduler does, to reject an unsupported model before any worker starts) pulls in no model code,
and a model file that fails to import breaks only that architecture.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence

MODEL_REGISTRY: dict[str, str] = {
    "LlamaForCausalLM": "workers.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "workers.models.mistral:MistralForCausalLM",
    "Qwen2ForCausalLM": "workers.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "workers.models.qwen3:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "workers.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "workers.models.gemma3:Gemma3ForCausalLM",
    # The multimodal checkpoint: we serve its text part (the model skips the vision tower's weights).
    "Gemma3ForConditionalGeneration": "workers.models.gemma3:Gemma3ForCausalLM",
    "Gemma4ForCausalLM": "workers.models.gemma4:Gemma4ForCausalLM",
    # The multimodal checkpoint: we serve its text part (the vision and audio towers are not read).
    "Gemma4ForConditionalGeneration": "workers.models.gemma4:Gemma4ForCausalLM",
    "Cohere2ForCausalLM": "workers.models.cohere2:Cohere2ForCausalLM",
    "BambaForCausalLM": "workers.models.bamba:BambaForCausalLM",
    "NemotronHForCausalLM": "workers.models.nemotron_h:NemotronHForCausalLM",
    "FalconH1ForCausalLM": "workers.models.falcon_h1:FalconH1ForCausalLM",
    "JambaForCausalLM": "workers.models.jamba:JambaForCausalLM",
    "GraniteMoeHybridForCausalLM": "workers.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
    "GptOssForCausalLM": "workers.models.gpt_oss:GptOssForCausalLM",
    "Llama4ForCausalLM": "workers.models.llama4:Llama4ForCausalLM",
    # The multimodal checkpoint: we serve its text part (the vision tower's weights are not read).
    "Llama4ForConditionalGeneration": "workers.models.llama4:Llama4ForCausalLM",
    "Qwen3NextForCausalLM": "workers.models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "workers.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "workers.models.qwen3_5:Qwen3_5MoeForCausalLM",
    # The multimodal checkpoints: we serve their text part (the vision tower's weights are not read).
    "Qwen3_5ForConditionalGeneration": "workers.models.qwen3_5:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForConditionalGeneration": "workers.models.qwen3_5:Qwen3_5MoeForCausalLM",
}


class UnsupportedArchitectureError(ValueError):
    """The config names no architecture we implement; raised before any weight is read."""


def supported_architectures() -> list[str]:
    """The names a config's `architectures` may hold, sorted for error messages and docs."""
    return sorted(MODEL_REGISTRY)


def _import_entry(architecture: str, entry: str) -> type:
    module_name, _, class_name = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ImportError(f"the implementation of {architecture} ({entry}) could not be imported: {e}") from e
    try:
        return getattr(module, class_name)
    except AttributeError as e:
        raise ImportError(f"the implementation of {architecture}: {module_name} has no {class_name}") from e


def get_model_class(architectures: Sequence[str] | None) -> type:
    """Our class for the first architecture of the config that we implement.

    A config may list several names (HF lists the head it was saved with first); taking the first
    supported one follows transformers' own choice.
    """
    for architecture in architectures or ():
        entry = MODEL_REGISTRY.get(architecture)
        if entry is not None:
            return _import_entry(architecture, entry)
    given = ", ".join(architectures) if architectures else "none (config.json has no 'architectures')"
    raise UnsupportedArchitectureError(
        f"unsupported model architecture: {given}; supported: {', '.join(supported_architectures())}")
