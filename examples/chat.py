"""A chat turn through the tokenizer's chat template: `python examples/chat.py MODEL`."""
import sys

from distengine import LLM, SamplingParams

model = sys.argv[1] if len(sys.argv) > 1 else "Qwen/Qwen3-0.6B"
messages = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Name three hybrid-attention models."}]
with LLM(model) as llm:
    print(llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=80))[0].outputs[0].text)
