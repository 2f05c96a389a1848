"""Mistral: Llama's layers; its sliding window comes from the config (`sliding_window`)."""
from workers.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
