"""`distengine generate`: completions of a model for text prompts or token ids."""
from __future__ import annotations

import argparse

from distengine.model_config import KV_CACHE_DTYPES


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids are integers separated by commas or spaces, got {text!r}")
    if not ids:
        raise argparse.ArgumentTypeError("an empty list of token ids")
    return ids


def run(args) -> int:
    from distengine import LLM, SamplingParams
    prompts: list = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    prompts += [{"prompt_token_ids": ids} for ids in args.prompt_token_ids or []]
    if not prompts:
        raise ValueError("give --prompt TEXT, --prompts-file FILE or --prompt-token-ids IDS")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    with LLM(args.model, tensor_parallel_size=args.tensor_parallel_size, tokenizer=args.tokenizer,
             device=args.device, dtype=args.dtype, max_model_len=args.max_model_len,
             gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
             kv_cache_dtype=args.kv_cache_dtype) as llm:
        if llm.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError(f"{args.model} has no tokenizer: give --tokenizer, or prompts as --prompt-token-ids")
        for out in llm.generate(prompts, params):
            comp = out.outputs[0]
            print(f"--- {out.prompt!r}" if out.prompt is not None else f"--- token ids {out.prompt_token_ids}")
            print(comp.text if llm.tokenizer is not None else f"token ids {comp.token_ids}")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="a model folder or a Hugging Face hub id")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder or hub id (default: the model's)")
    p.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="a file of text prompts, one per line")
    p.add_argument("--prompt-token-ids", action="append", type=_token_ids, metavar="IDS",
                   help="a prompt as token ids, e.g. '1,2,3' (repeatable; no tokenizer needed)")
    p.add_argument("-tp", "--tensor-parallel-size", "--tp", type=int, default=1, dest="tensor_parallel_size",
                   help="tensor-parallel workers (Ray actors beyond 1)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus probability, 1 is off")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 is off")
    p.add_argument("--seed", type=int, default=None, help="per-request seed for sampling")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="model dtype (auto: the checkpoint's; a float32 checkpoint runs in bfloat16 on GPUs)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="where the workers run")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the longest prompt plus output (default: the model's max_position_embeddings)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of each GPU the engine may use (weights, activations, KV cache)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the attention K/V's dtype: auto (the model's) or fp8 / fp8_e4m3 (e4m3 with per-layer "
                        "scales, twice the tokens)")
