"""distengine: a distributed, tensor-parallel inference engine for hybrid LLMs.

`from distengine import LLM, SamplingParams`: imported lazily, so that the light parts (the KV
cache plan, `distengine kv-plan`) do not pull in torch, transformers and Ray.
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    if name == "LLM":
        from distengine.llm import LLM
        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from distengine import sampling_params
        return getattr(sampling_params, name)
    if name in ("RequestOutput", "CompletionOutput"):
        from distengine import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'distengine' has no attribute {name!r}")
