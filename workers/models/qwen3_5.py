"""Qwen3.5 / Qwen3.6 (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, and the text part of the
published Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration checkpoints):
Qwen3-Next's decoder (`workers/models/qwen3_next.py`) with

* the Gated DeltaNet projections split (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`);
* an MLP in every layer (Qwen3.5), or the sparse MoE block with its shared expert in every
  layer (Qwen3.5-MoE: no `mlp_only_layers` / `decoder_sparse_step`, and the top-k weights always
  renormalised, as transformers' Qwen3_5MoeTopKRouter);
* the rotary embedding of `rope_parameters`, multimodal (mrope, `mrope_section`): transformers'
  Qwen3_5TextRotaryEmbedding gives the temporal, height and width sections of the rotary dims
  each their own position id, and for text tokens the three ids are the same (the text position
  broadcast to all three by Qwen3_5TextModel, and what get_rope_index gives a prompt without
  images), so every section rotates by that one position: plain 1-D rope over the
  `partial_rotary_factor` share of the head, what the template's rope cache computes. Images and
  video (whose tokens would take other ids) are not served.

The multimodal checkpoints keep the language model under `model.language_model.` (and the head
at `lm_head.`); the vision tower (`model.visual.*`) and the multi-token-prediction layers
(`mtp.*`) are not built and their tensors not read. Text-only checkpoints saved by transformers
name the weights `model.*`; transformers also reads `model.language_model.*` for them: both load.
The tied embeddings follow the wrapper's `tie_word_embeddings`, as transformers ties them.
"""
from __future__ import annotations

import copy

from workers.models.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextForCausalLM

MODEL, TEXT = "model.", "model.language_model."


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    def is_moe(self, config) -> bool:
        return False


class Qwen3_5MoeDecoderLayer(Qwen3NextDecoderLayer):
    def is_moe(self, config) -> bool:
        return True

    def renormalize(self, config) -> bool:
        return True


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    decoder_layer_cls = Qwen3_5DecoderLayer
    projection_layout = "split"
    ignored_prefixes = ("model.visual.", "mtp.")

    def text_part(self, config):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.multimodal = text is not config
        if self.multimodal and hasattr(config, "tie_word_embeddings"):
            text = copy.copy(text)
            text.tie_word_embeddings = bool(config.tie_word_embeddings)
        return text

    # ---- weights: `model.` or `model.language_model.` ----------------------------------------
    def our_name(self, checkpoint_name: str) -> str:
        if checkpoint_name.startswith(TEXT):
            return MODEL + checkpoint_name[len(TEXT):]
        return checkpoint_name

    def spellings(self, name: str) -> tuple[str, ...]:
        if not name.startswith(MODEL):
            return (name,)
        text = TEXT + name[len(MODEL):]
        return (text, name) if self.multimodal else (name, text)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    decoder_layer_cls = Qwen3_5MoeDecoderLayer


__all__ = ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"]
