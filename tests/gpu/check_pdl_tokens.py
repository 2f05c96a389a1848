"""On a GPU: greedy tokens of a large model with PDL on and off (run twice, DISTENGINE_PDL=1 / 0,
and compare the printed digests): a kernel that read before its producer finished would show
here, at batches 1, 8 and 64 of a 12B-shaped model on random weights.

    DISTENGINE_PDL=1 python tests/gpu/check_pdl_tokens.py /tmp/g12d --load-format dummy
"""
from __future__ import annotations

import argparse
import hashlib

import torch

from distengine import LLM, SamplingParams


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--load-format", default="auto")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLM(args.model, load_format=args.load_format, max_model_len=1024) as llm:
        for batch in (1, 8, 64):
            prompts = [{"prompt_token_ids": torch.randint(10, 200000, (200 + 3 * i,), generator=g).tolist()}
                       for i in range(batch)]
            ids = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
            digest = hashlib.sha256(repr(ids).encode()).hexdigest()[:16]
            print(f"batch {batch}: tokens {digest} (distinct first tokens: {len({t[0] for t in ids})})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
