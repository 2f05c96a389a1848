"""`distengine demo`: the engine end to end on a tiny random hybrid model built locally (no
download): Gemma-3-style layers (5 sliding-window : 1 full), a small word-level tokenizer,
tensor-parallel workers on Ray (GPUs when there are enough, else CPU), a batch of requests that
share a system prompt."""
from __future__ import annotations

import os
import time

WORDS = ("the a of and to in is you that it he was for on are as with his they I at be this have from or one "
         "had by word but not what all were we when your can said there use an each which she do how their if "
         "will up other about out many then them these so some her would make like him into time has look two "
         "more write go see number no way could people my than first water been call who oil its now find long "
         "down day did get come made may part assistant helpful answer question system user please short").split()
SYSTEM = ("you are a helpful assistant . answer each question in a short way and do not make up what you "
          "can not find . if the user asks about water or oil say what you know and then stop .")
QUESTIONS = ["what is water", "how long is a day", "who made the first call", "can you find oil",
             "what do people write", "how many words are there", "why do we look up", "where is the long way"]


def build_model(folder: str) -> None:
    """A random Gemma-3-shaped model (6 layers: 5 sliding, 1 full) and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "."] + sorted(set(WORDS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")
    fast.save_pretrained(folder)
    save_random_model(folder, vocab_size=len(vocab), eos_token_id=1, bos_token_id=2, pad_token_id=0)


def save_random_model(folder: str, vocab_size: int, eos_token_id: int, bos_token_id: int, pad_token_id: int) -> None:
    """The tiny model's weights (seeded, so the same on every build) for a tokenizer of `vocab_size` tokens."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=16,
                              sliding_window_pattern=6, max_position_embeddings=512, eos_token_id=eos_token_id,
                              bos_token_id=bos_token_id, pad_token_id=pad_token_id)
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).to(torch.float32).save_pretrained(folder)


def default_model_dir() -> str:
    """Under the user's cache folder, named by a hash of the model's definition: a change to it
    (the code above) builds a new model instead of reusing a stale one."""
    import hashlib
    import inspect
    source = inspect.getsource(build_model) + inspect.getsource(save_random_model)
    key = hashlib.sha256((source + " ".join(WORDS)).encode()).hexdigest()[:12]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "distengine", f"demo-model-{key}")


def run(args) -> int:
    import torch

    from distengine import LLM, SamplingParams
    folder = args.model_dir or default_model_dir()
    if not os.path.exists(os.path.join(folder, "config.json")):
        print(f"building the tiny model in {folder}", flush=True)
        build_model(folder)
    gpus = torch.cuda.device_count()
    device = "cuda" if gpus >= args.tp else "cpu"
    print(f"tiny hybrid model in {folder}; {args.tp} worker(s) on {'GPUs' if device == 'cuda' else 'CPU'}"
          + (" via Ray" if args.tp > 1 else ""), flush=True)
    t0 = time.perf_counter()
    with LLM(folder, tensor_parallel_size=args.tp, device=device, dtype="float32", block_size=16,
             max_model_len=512) as llm:
        started = time.perf_counter() - t0
        plan = llm.plan
        print(f"KV cache plan: {len(plan.groups)} groups of {plan.num_slots} layer slots sharing one pool of "
              f"{llm.scheduler.manager.pool.num_blocks - 1} blocks of {plan.block_size} tokens "
              f"({plan.block_bytes / 1024:.0f} KiB per block id per rank)")
        for g in plan.groups:
            layers = ", ".join(name.rsplit(".", 1)[-1] for name in g.layers if name)
            print(f"  group {g.group_id}: {g.spec.describe()}, layers {layers}")
        prompts = [f"{SYSTEM} user : {q} assistant :" for q in QUESTIONS]
        params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=args.max_tokens)
        t1 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        took = time.perf_counter() - t1
        for q, o in zip(QUESTIONS, outs):
            print(f"Q: {q}\nA: {o.outputs[0].text!r}  ({len(o.outputs[0].token_ids)} tokens, "
                  f"{o.num_cached_tokens} prompt tokens from the prefix cache)")
        stats = llm.stats()
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        shared = len(llm.tokenizer(f"{SYSTEM} user :")["input_ids"])
        print(f"\nengine start {started:.1f} s; generation {took:.2f} s, {n_out / took:.1f} output tokens/s")
        print(f"prefix-cache hit rate {stats.prefix_cache_hit_rate:.1%}; peak KV usage {stats.peak_kv_usage:.2%}; "
              f"preemptions {stats.preemptions}")
        print(f"the prompts share their first {shared} tokens; hits come in whole blocks of {plan.block_size} "
              f"tokens, so {shared // plan.block_size * plan.block_size} of them are found in the cache")
        for tokens in (100, plan.max_model_len):
            ours, uniform = plan.bytes_per_request(tokens), plan.uniform_bytes_per_request(tokens)
            print(f"KV held by one request of {tokens} tokens, per rank: hybrid layout {ours / 1024:.0f} KiB vs "
                  f"uniform {uniform / 1024:.0f} KiB ({uniform / ours:.2f}x less memory)")
    return 0


def add_arguments(p) -> None:
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel workers")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt")
    p.add_argument("--model-dir", default=None,
                   help="where the tiny model is built (default: ~/.cache/distengine/demo-model-HASH, "
                        "HASH of its definition)")
