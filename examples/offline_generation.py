"""Offline generation: `python examples/offline_generation.py MODEL [TP]` (a folder or a hub id)."""
import sys

from distengine import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-0.6B"
tp = int(sys.argv[2]) if len(sys.argv) > 2 else 1
system = "You are a concise assistant. Answer in one sentence. "
prompts = [system + q for q in ("What is a KV cache?", "Why use sliding-window attention?", "What is Ray?")]
with LLM(model, tensor_parallel_size=tp) as llm:
    for out in llm.generate(prompts, SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64)):
        print(f"{out.prompt!r}\n  -> {out.outputs[0].text!r} ({out.num_cached_tokens} cached prompt tokens)")
    print(llm.stats())
