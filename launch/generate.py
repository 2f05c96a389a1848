"""`distengine generate`: completions of a model from the command line."""
from __future__ import annotations


def run(args) -> int:
    from distengine import LLM, SamplingParams
    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise SystemExit("distengine generate: give --prompt TEXT or --prompts-file FILE")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    with LLM(args.model, tensor_parallel_size=args.tp, max_model_len=args.max_model_len) as llm:
        for out in llm.generate(prompts, params):
            print(f"--- {out.prompt!r}\n{out.outputs[0].text}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="a model folder or a Hugging Face hub id")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-model-len", type=int, default=None)
