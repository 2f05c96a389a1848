"""On a GPU: the pieces of a decode step at batch > 1, each timed inside a CUDA graph of calls on
their own weights / caches (as `micro_b1.py` does for batch 1), against the copy-rate time of the
bytes they must read:

- cuBLAS (`F.linear`) at Gemma-3-12B's projection shapes for 1..128 rows;
- decode paged attention (Gemma-3's 16 query / 8 KV heads of 256, block 16) at batch 8..128, the
  engine's split choice against fixed split counts and tile shapes.

    python tests/gpu/micro_batch.py
"""
from __future__ import annotations

import math

import torch

from kernels.paged_attention import default_config, paged_attention
from launch.bench_common import copy_bandwidth
from tests.gpu.micro_b1 import REPS, graph_time_us

SHAPES = {"qkv": (8192, 3840), "o_proj": (3840, 4096), "gate_up": (30720, 3840), "down": (3840, 15360)}
ROWS = (1, 8, 16, 32, 64, 128)


def linear_rows(bw: float) -> None:
    dt, dev = torch.bfloat16, "cuda"
    print(f"{'op':10} " + " ".join(f"{'M=' + str(m):>14}" for m in ROWS) + "   (us/call, x ideal)")
    total = {m: 0.0 for m in ROWS}
    ideal_total = 0.0
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(REPS)]
        ideal = N * K * 2 / bw * 1e6
        ideal_total += ideal
        cells = []
        for m in ROWS:
            x = torch.randn(m, K, device=dev, dtype=dt)
            ys = [torch.empty(m, N, device=dev, dtype=dt) for _ in range(REPS)]
            t = graph_time_us([lambda w=w, y=y: torch.nn.functional.linear(x, w, out=y) for w, y in zip(ws, ys)])
            total[m] += t
            cells.append(f"{t:7.1f} {t / ideal:5.2f}x")
        print(f"{name:10} " + " ".join(f"{c:>14}" for c in cells))
        del ws
        torch.cuda.empty_cache()
    print(f"{'layer':10} " + " ".join(f"{total[m]:7.1f} {total[m] / ideal_total:5.2f}x" for m in ROWS))
    print("48 layers: " + " ".join(f"{48 * total[m] / 1e3:6.2f} ms" for m in ROWS)
          + f"  (ideal {48 * ideal_total / 1e3:.2f} ms)")


def attention_batches(bw: float) -> None:
    dt, dev = torch.bfloat16, "cuda"
    HQ, HKV, D, BS = 16, 8, 256, 16
    print(f"\n{'attention':18} {'variant':28} {'us/call':>8} {'ideal':>7} {'x ideal':>7}")
    for B, L in ((8, 600), (16, 600), (32, 600), (64, 600), (128, 600), (16, 2048), (32, 2048), (64, 2048)):
        per = math.ceil(L / BS)
        reps = max(4, min(REPS, int(24e9 // (B * per * BS * HKV * D * 4))))
        caches = [torch.randn(B * per + 1, 2, BS, HKV, D, device=dev, dtype=dt) for _ in range(reps)]
        table = torch.arange(1, B * per + 1, device=dev, dtype=torch.int32).view(B, per)
        q = torch.randn(B, HQ, D, device=dev, dtype=dt)
        qsl = torch.arange(B + 1, device=dev, dtype=torch.int32)
        lens = torch.full((B,), L, device=dev, dtype=torch.int32)
        out = torch.empty_like(q)
        ideal = B * L * HKV * D * 4 / bw * 1e6
        bound = L + 128  # the engine's graphs are bounded by max_model_len (= in + out in the bench)
        ref = paged_attention(q, caches[0], table, qsl, lens, 1, bound, D ** -0.5).float()
        base = default_config(1, D, 2, BS, 0, bound)
        cases = [("shipped", None, None)]
        cases += [(f"tile {base['TILE_N']} splits {sp}", base, sp) for sp in (1, 2, 4, 8)]
        cases += [(f"tile 32 st 2 splits {sp}", dict(base, TILE_N=32), sp) for sp in (1, 2, 4)]
        cases += [(f"tile 64 st 1 splits {sp}", dict(base, num_stages=1), sp) for sp in (1, 2, 4)]
        for label, cfg, splits in cases:
            o = paged_attention(q, caches[0], table, qsl, lens, 1, bound, D ** -0.5, out=out, num_splits=splits,
                                config=cfg)
            if (o.float() - ref).abs().max().item() > 2e-2:
                print(f"  B={B} L={L} {label}: wrong")
                continue
            t = graph_time_us([lambda c=c, cfg=cfg, splits=splits: paged_attention(
                q, c, table, qsl, lens, 1, bound, D ** -0.5, out=out, num_splits=splits, config=cfg) for c in caches])
            print(f"{f'B={B} L={L}':18} {label:28} {t:8.2f} {ideal:7.2f} {t / ideal:7.2f}")
        del caches
        torch.cuda.empty_cache()


def main() -> int:
    bw = copy_bandwidth("cuda")
    print(f"copy {bw / 1e12:.2f} TB/s")
    linear_rows(bw)
    attention_batches(bw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
