"""On a GPU: paged attention at Gemma-3-12B's shape (D=256, 16 query / 8 KV heads, block 16) or,
with `--heads gemma4`, Gemma-4-31B's full layers (D=512, 32 query / 4 KV heads; `HEADS` has more):
the shipped config against a sweep of tiles, warps, stages and (for small batches) splits; decode
as KV bytes read over time against the copy bandwidth, prefill (`--prefill`) as attention FLOP/s;
same run.
`--kv-cache-dtype fp8`: the cache in e4m3 with its scales (decode's bytes: 1 an element).
Prints the best configs per case.

    python -m kernels.bench.sweep_decode_attention [--heads NAME] [--prefill] [--kv-cache-dtype fp8]
        [--case BATCH CONTEXT WINDOW ...]
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch
from triton.testing import do_bench

from kernels.kv_store import FP8_DTYPE
from kernels.paged_attention import _num_sms, batch_fills_gpu, choose_num_splits, default_config, paged_attention

# query heads, KV heads, head size; "qwen3.6": Qwen3.6-35B-A3B's attention (GQA 8), "gqa4-128": a
# Llama-style layer of 128-wide heads
HEADS = {"gemma3": (16, 8, 256), "gemma4": (32, 4, 512), "qwen3.6": (16, 2, 256), "gqa4-128": (32, 8, 128)}
HQ, HKV, D = HEADS["gemma3"]
BS = 16
CASES = [(128, 600, 0), (128, 600, 1024), (16, 16384, 0), (16, 16384, 1024), (1, 600, 0), (1, 600, 1024)]
PREFILL_CASES = [(1, 2048, 0), (1, 8192, 0), (4, 2048, 1024)]  # sequences, tokens each, window
SCALES: dict = {}  # an fp8 cache's k_scale and v_scale (`--kv-cache-dtype fp8`)
# Gemma 4's head-512 layers are its full ones: no window cases.


def paged(batch: int, length: int, g: torch.Generator):
    per = math.ceil(length / BS)
    n = batch * per + 1
    kv = torch.randn(n, 2, BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    if SCALES:
        kv = (kv * 16).to(FP8_DTYPE)  # read back with scales 1/16
    table = (torch.randperm(n - 1, device="cuda", generator=g) + 1).view(batch, per).to(torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    return q, kv, table, qsl, lens


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (do_bench(lambda: y.copy_(x), return_mode="median") / 1e3)


def prefill(num_seqs: int, length: int, window: int, g: torch.Generator) -> None:
    """Whole prompts (no cached prefix): each configuration against the shipped one, causal FLOPs
    (a window's keys only) over time."""
    q, kv, table, _, lens = paged(num_seqs, length, g)
    q = torch.randn(num_seqs * length, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qsl = torch.arange(0, num_seqs * length + 1, length, device="cuda", dtype=torch.int32)
    keys = sum(min(i + 1, window) if window else i + 1 for i in range(length))
    flops = 4 * num_seqs * HQ * D * keys

    def call(cfg=None):
        return paged_attention(q, kv, table, qsl, lens, length, length, D ** -0.5, sliding_window=window, config=cfg,
                               **SCALES)
    ref = call()
    base = do_bench(call, warmup=5, rep=40, return_mode="median")
    shipped = default_config(length, D, HQ // HKV, BS, window, length)
    results = []
    for bm, tile, warps, stages in itertools.product((32, 64, 128), (16, 32, 64), (4, 8), (1, 2)):
        if bm < HQ // HKV:
            continue
        cfg = {"BLOCK_M": bm, "TILE_N": tile, "num_warps": warps, "num_stages": stages}
        try:
            err = float((call(cfg).float() - ref.float()).abs().max())
            results.append((do_bench(lambda: call(cfg), warmup=5, rep=40, return_mode="median"), cfg, err))
        except Exception as e:  # noqa: BLE001 - out of shared memory and the like
            results.append((float("inf"), cfg, repr(e)[:40]))
    results.sort(key=lambda r: r[0])
    print(f"prefill {num_seqs} x {length} W={window}: shipped {base:.3f} ms ({flops / base / 1e9:.0f} TFLOP/s, {shipped})")
    for ms, cfg, err in results[:4]:
        print(f"   {ms:.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  {cfg} err {err}")


def main() -> int:
    global HQ, HKV, D
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--heads", choices=sorted(HEADS), default="gemma3")
    p.add_argument("--prefill", action="store_true", help="sweep prefill tiles instead of decode")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="auto: bf16")
    p.add_argument("--case", type=int, nargs=3, action="append", metavar=("BATCH", "CONTEXT", "WINDOW"),
                   help="decode cases to run instead of the built-in ones (repeatable; window 0: none)")
    args = p.parse_args()
    HQ, HKV, D = HEADS[args.heads]
    if args.kv_cache_dtype == "fp8":
        SCALES.update(k_scale=torch.full((1,), 1 / 16, device="cuda"), v_scale=torch.full((1,), 1 / 16, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.prefill:
        for case in PREFILL_CASES:
            if not (args.heads == "gemma4" and case[2]):
                prefill(*case, g)
        return 0
    bw = copy_bandwidth()
    print(f"copy {bw / 1e12:.2f} TB/s; {_num_sms(torch.device('cuda'))} SMs; heads {HQ}/{HKV} x {D}")
    for batch, length, window in args.case or CASES:
        if args.heads == "gemma4" and window:
            continue
        q, kv, table, qsl, lens = paged(batch, length, g)
        read = min(length, window) if window else length
        nbytes = batch * read * HKV * D * 2 * kv.element_size()
        ref = paged_attention(q, kv, table, qsl, lens, 1, length, D ** -0.5, sliding_window=window, **SCALES)
        base_cfg = default_config(1, D, HQ // HKV, BS, window, length, fp8=kv.element_size() == 1,
                                  fills_gpu=batch_fills_gpu(batch, HKV, _num_sms(q.device)))
        base_splits = choose_num_splits(batch, HKV, length, _num_sms(q.device), base_cfg["TILE_N"],
                                        max_splits=8 if D > 256 else 32)
        results = []
        if batch == 1:  # latency-bound: only the split count matters
            grid = [(base_cfg["TILE_N"], base_cfg["num_warps"], base_cfg["num_stages"], sp) for sp in (1, 2, 4, 8, 16)]
        else:
            grid = [(t, w, st, base_splits) for t, w, st in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3))]
        f16 = (False, True) if SCALES else (False,)
        for (tile, warps, stages, splits), f16_dot in itertools.product(grid, f16):
            cfg = {"BLOCK_M": base_cfg["BLOCK_M"], "TILE_N": tile, "num_warps": warps, "num_stages": stages,
                   "F16_DOT": f16_dot}
            try:
                out = paged_attention(q, kv, table, qsl, lens, 1, length, D ** -0.5, sliding_window=window,
                                      config=cfg, num_splits=splits, **SCALES)
                err = float((out.float() - ref.float()).abs().max())
                ms = do_bench(lambda: paged_attention(q, kv, table, qsl, lens, 1, length, D ** -0.5,
                                                      sliding_window=window, config=cfg, num_splits=splits,
                                                      **SCALES),
                              warmup=10, rep=60, return_mode="median")
                results.append((ms, tile, warps, stages, splits, f16_dot, err))
            except Exception as e:  # noqa: BLE001 - out of shared memory and the like
                results.append((float("inf"), tile, warps, stages, splits, f16_dot, repr(e)[:40]))
        base = do_bench(lambda: paged_attention(q, kv, table, qsl, lens, 1, length, D ** -0.5, sliding_window=window,
                                                **SCALES),
                        warmup=10, rep=60, return_mode="median")
        results.sort()
        print(f"B={batch} L={length} W={window}: shipped {base * 1e3:.1f} us ({nbytes / base / 1e9:.2f} TB/s, "
              f"{base_cfg['TILE_N']}/{base_cfg['num_warps']}w/{base_cfg['num_stages']}s/{base_splits}sp)")
        for ms, tile, warps, stages, splits, f16_dot, err in results[:6]:
            print(f"   {ms * 1e3:7.1f} us {nbytes / ms / 1e9:5.2f} TB/s  tile {tile} warps {warps} stages {stages} "
                  f"splits {splits}{' f16 products' if f16_dot else ''} err {err}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
