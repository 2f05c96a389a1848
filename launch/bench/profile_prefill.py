"""On a GPU: where a prefill step goes (torch.profiler): the step's wall time, the device-busy
time by kind of kernel (matrix products, attention, the rest), and the matrix products' rate
against the product rate measured in the same run, over ten products and held over half a
second (`kernels.bench.roofline.matmul_rate`: a GPU at its power limit lowers its clocks within a
fraction of a second of products).

    python -m launch.bench.profile_prefill MODEL_DIR [--tokens 2048 8192] [--input-len 512] [--load-format dummy]
        [--quantization fp8] [--top 12]

Each case queues enough prompts of --input-len tokens that every profiled step is a full prefill
step of --tokens tokens (max_num_batched_tokens), with no decodes beside it.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from distengine import LLM, SamplingParams
from distengine.hf_config import load_hf_config, resolve_model_path
from distengine.quantization import QUANTIZATION_CHOICES
from distengine.scheduler import EngineRequest
from kernels.bench.roofline import matmul_rate
from launch.bench.common import random_prompts, roofline_of
from launch.bench.profile_decode import device_us, kernel_averages

KINDS = (("matrix products", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "_skinny", "_gemv")),
         ("attention", ("paged_attention", "_attn", "attention", "flash")),
         ("norms", ("rmsnorm", "rms_norm", "layernorm")),
         ("rotary / q-k norm", ("rope", "rotary")),
         ("activations", ("silu", "gelu", "act_and_mul")),
         ("KV store", ("kv_store", "store_kv", "reshape_and_cache")),
         ("state mixers", ("_gdn", "gated_delta", "_ssd", "_conv_", "state_update", "mamba")),
         ("expert routing", ("moe", "topk")))


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help="as `bench latency --quantization`")
    p.add_argument("--top", type=int, default=12, help="kernels listed per case")
    args = p.parse_args()
    rate = matmul_rate("cuda")
    held = matmul_rate("cuda", seconds=0.5)
    print(f"product rate {rate / 1e12:.0f} TFLOP/s over ten products, {held / 1e12:.0f} held over 0.5 s "
          f"(bf16, same run)")
    for tokens in args.tokens:
        steps, timed = 6, 2
        n = tokens * (steps + timed + 2) // args.input_len
        with LLM(args.model, load_format=args.load_format, quantization=args.quantization,
                 max_model_len=args.input_len + 8,
                 max_num_batched_tokens=tokens, max_num_seqs=max(n, 1)) as llm:
            # The products of a prefill token: every weight but the embedding table and the LM head
            # (it runs on each prompt's last token only); of routed experts, the k of E a token uses.
            rf = roofline_of(llm, bandwidth=1.0, matmul=rate)
            hf = load_hf_config(resolve_model_path(args.model)).get_text_config()
            params = rf.num_params - hf.vocab_size * hf.hidden_size
            core = llm.engine
            prompts = random_prompts(llm.info.vocab_size, n, args.input_len, tokens)
            for i, pr in enumerate(prompts):
                core.add_request(EngineRequest(f"{tokens}-{i}", pr["prompt_token_ids"],
                                               sampling=SamplingParams(temperature=0.0, max_tokens=1)))
            core.step()  # warm-up step
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(timed):
                core.step()
            torch.cuda.synchronize()
            plain = (time.perf_counter() - t) / timed
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    core.step()
                torch.cuda.synchronize()
            events = kernel_averages(prof)
            busy = sum(device_us(e) for e in events) / steps / 1e3
            by_kind: dict[str, float] = {}
            for e in events:
                by_kind[kind_of(e.key)] = by_kind.get(kind_of(e.key), 0.0) + device_us(e) / steps / 1e3
            flops = 2 * params * tokens
            print(f"\n{tokens} prefill tokens per step: step {plain * 1e3:.1f} ms (no profiler), device busy "
                  f"{busy:.1f} ms; products floor {flops / rate * 1e3:.1f} ms at the measured rate "
                  f"({plain / (flops / rate):.2f}x); {flops / held * 1e3:.1f} ms at the held rate, which the "
                  f"step's products may beat (the kernels between them let the clocks recover)")
            for kind, ms in sorted(by_kind.items(), key=lambda kv: -kv[1]):
                extra = f"  ({flops / (ms / 1e3) / 1e12:.0f} TFLOP/s)" if kind == "matrix products" else ""
                print(f"  {kind:18} {ms:7.2f} ms{extra}")
            for e in sorted(events, key=device_us, reverse=True)[:args.top]:
                print(f"  {device_us(e) / steps / 1e3:7.3f} ms  x{e.count / steps:5.0f}  {e.key[:90]}")
            core.abort([f"{tokens}-{i}" for i in range(n)])
            while core.scheduler.has_in_flight() or core.has_unfinished():
                core.step()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
