"""On a GPU: decode paged attention at Gemma-3-12B's shape (D=256, 16 query / 8 KV heads, block 16),
the shipped config against a sweep of tiles, warps, stages and (for small batches) splits; KV bytes
read over time against the copy bandwidth, same run. Prints the best config per case.

    python -m kernels.bench.sweep_decode_attention
"""
from __future__ import annotations

import itertools
import math

import torch
from triton.testing import do_bench

from kernels.paged_attention import _num_sms, choose_num_splits, default_config, paged_attention

HQ, HKV, D, BS = 16, 8, 256, 16
CASES = [(128, 600, 0), (128, 600, 1024), (16, 16384, 0), (16, 16384, 1024), (1, 600, 0), (1, 600, 1024)]


def paged(batch: int, length: int, g: torch.Generator):
    per = math.ceil(length / BS)
    n = batch * per + 1
    kv = torch.randn(n, 2, BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    table = (torch.randperm(n - 1, device="cuda", generator=g) + 1).view(batch, per).to(torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    return q, kv, table, qsl, lens


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / (do_bench(lambda: y.copy_(x), return_mode="median") / 1e3)


def main() -> int:
    g = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy {bw / 1e12:.2f} TB/s; {_num_sms(torch.device('cuda'))} SMs")
    for batch, length, window in CASES:
        q, kv, table, qsl, lens = paged(batch, length, g)
        read = min(length, window) if window else length
        nbytes = batch * read * HKV * D * 2 * 2
        ref = paged_attention(q, kv, table, qsl, lens, 1, length, D ** -0.5, sliding_window=window)
        base_cfg = default_config(1, D, HQ // HKV, BS, window, length)
        base_splits = choose_num_splits(batch, HKV, length, _num_sms(q.device), base_cfg["TILE_N"])
        results = []
        if batch == 1:  # latency-bound: only the split count matters
            grid = [(base_cfg["TILE_N"], base_cfg["num_warps"], base_cfg["num_stages"], sp) for sp in (1, 2, 4, 8, 16)]
        else:
            grid = [(t, w, st, base_splits) for t, w, st in itertools.product((32, 64, 128), (4, 8), (1, 2, 3))]
        for tile, warps, stages, splits in grid:
            cfg = {"BLOCK_M": 16, "TILE_N": tile, "num_warps": warps, "num_stages": stages}
            try:
                out = paged_attention(q, kv, table, qsl, lens, 1, length, D ** -0.5, sliding_window=window,
                                      config=cfg, num_splits=splits)
                err = float((out.float() - ref.float()).abs().max())
                ms = do_bench(lambda: paged_attention(q, kv, table, qsl, lens, 1, length, D ** -0.5,
                                                      sliding_window=window, config=cfg, num_splits=splits),
                              warmup=10, rep=60, return_mode="median")
                results.append((ms, tile, warps, stages, splits, err))
            except Exception as e:  # noqa: BLE001 - out of shared memory and the like
                results.append((float("inf"), tile, warps, stages, splits, repr(e)[:40]))
        base = do_bench(lambda: paged_attention(q, kv, table, qsl, lens, 1, length, D ** -0.5, sliding_window=window),
                        warmup=10, rep=60, return_mode="median")
        results.sort()
        print(f"B={batch} L={length} W={window}: shipped {base * 1e3:.1f} us ({nbytes / base / 1e9:.0f} GB/s, "
              f"{base_cfg['TILE_N']}/{base_cfg['num_warps']}w/{base_cfg['num_stages']}s/{base_splits}sp)")
        for ms, tile, warps, stages, splits, err in results[:4]:
            print(f"   {ms * 1e3:7.1f} us {nbytes / ms / 1e9:6.0f} GB/s  tile {tile} warps {warps} stages {stages} "
                  f"splits {splits} err {err}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
