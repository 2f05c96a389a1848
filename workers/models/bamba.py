"""Bamba: Mamba-2 layers and a few full-attention layers (`attn_layer_indices`), each followed by
a gated MLP: the hybrid decoder as it comes (`workers/models/hybrid.py`), with the final norm
named `final_layernorm`."""
from __future__ import annotations

from workers.models.hybrid import HybridForCausalLM, HybridModel


class BambaForCausalLM(HybridForCausalLM):
    model_cls = HybridModel.named("final_layernorm")
