"""Gemma-3 (text): Gemma-2's layers with

* an RMSNorm (Gemma form) over each query and key head before RoPE;
* no attention soft-capping (HF's Gemma3Attention never passes `attn_logit_softcapping` to the
  attention function); final-logit soft-capping only if the config sets it (released ones don't);
* 5 sliding : 1 full layers, from the config's `layer_types` (or `sliding_window_pattern`);
* two RoPE bases: `rope_parameters["sliding_attention"]` (10k) for the sliding layers,
  `rope_parameters["full_attention"]` (1M, + linear scaling on the larger models) for the full
  ones (`rope_local_base_freq` / `rope_theta` / `rope_scaling` in older configs): the template's
  `rope_caches` builds one cache per layer type.

Also serves Gemma3ForConditionalGeneration checkpoints (text only): the model then receives the
wrapper's config (the text part is `config.get_text_config()`), the text weights live under
`model.language_model.` (transformers 5) or `language_model.model.` (older, still on the Hub,
`language_model.lm_head.` too), and the vision tower / projector tensors are skipped.
"""
from __future__ import annotations

from workers.models.base import multimodal_shapes, text_name
from workers.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM
from workers.parallel import TPGroup



class Gemma3Attention(Gemma2Attention):
    qk_norm = True

    def softcap(self, config) -> float:
        return 0.0


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    decoder_layer_cls = Gemma3DecoderLayer
    ignored_prefixes = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                        "multi_modal_projector.")

    def __init__(self, config, tp: TPGroup, dtype, device, max_positions: int | None = None) -> None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        super().__init__(text, tp, dtype, device, max_positions)
        self.hf_config = config
        self.multimodal = text is not config

    def checkpoint_to_param(self, name: str) -> tuple[str, object]:
        return super().checkpoint_to_param(text_name(name))

    def expected_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """A multimodal config does not say which layout its checkpoint uses: name both (the
        loader reads only the names the checkpoint has, and `missing_weights` maps them back)."""
        shapes = super().expected_checkpoint_shapes()
        return multimodal_shapes(shapes) if self.multimodal else shapes

    def missing_weights(self, loaded: set[str]) -> list[str]:
        # Against our own names (the parent's shapes), whichever layout the tensors came under.
        return sorted(set(super().expected_checkpoint_shapes()) - {text_name(n) for n in loaded})
