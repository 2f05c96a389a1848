"""On a GPU: the pieces of a decode step at batch > 1, each timed inside a CUDA graph of calls on
their own weights / caches (as `kernels/bench/decode_batch1.py` does for batch 1), against the copy-rate time of the
bytes they must read:

- cuBLAS (`F.linear`) against the layers' `linear_op` (the Triton gemv / skinny GEMM up to 32 rows)
  at Gemma-3-12B's projection shapes and their TP=2 shards, 1..128 rows;
- decode paged attention (Gemma-3's 16 query / 8 KV heads of 256, block 16) at batch 8..128, the
  engine's split choice against fixed split counts and tile shapes.

    python -m launch.bench.decode_batched
"""
from __future__ import annotations

import math

import torch

from kernels.bench.graph_timing import REPS, graph_time_us
from kernels.bench.roofline import copy_bandwidth
from kernels.paged_attention import default_config, paged_attention
from workers.ops import linear_op

SHAPES = {"qkv": (8192, 3840), "o_proj": (3840, 4096), "gate_up": (30720, 3840), "down": (3840, 15360)}
TP2 = {"qkv/2": (4096, 3840), "o_proj/2": (3840, 2048), "gate_up/2": (15360, 3840), "down/2": (3840, 7680)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


def linear_rows(bw: float) -> None:
    """cuBLAS against what the layers run (`linear_op`: gemv at 1 row, skinny_gemm at 2-32)."""
    dt, dev = torch.bfloat16, "cuda"
    print(f"{'op':10} {'rows':>4} {'ideal':>7} {'F.linear':>9} {'linear_op':>10} {'ratio':>6}")
    sums: dict[tuple[str, int], list[float]] = {}
    for name, (N, K) in {**SHAPES, **TP2}.items():
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(REPS)]
        ideal = N * K * 2 / bw * 1e6
        for m in ROWS:
            x = torch.randn(m, K, device=dev, dtype=dt)
            ys = [torch.empty(m, N, device=dev, dtype=dt) for _ in range(REPS)]
            ref = torch.nn.functional.linear(x.float(), ws[0].float())
            err = (linear_op(x, ws[0]).float() - ref).abs().max().item()
            assert err <= 0.02 * ref.abs().max().item(), f"{name} rows {m}: wrong ({err})"
            t_ref = graph_time_us([lambda w=w, y=y: torch.nn.functional.linear(x, w, out=y) for w, y in zip(ws, ys)])
            t_op = graph_time_us([lambda w=w: linear_op(x, w) for w in ws])
            key = ("TP=2" if "/" in name else "TP=1", m)
            acc = sums.setdefault(key, [0.0, 0.0, 0.0])
            acc[0] += ideal; acc[1] += t_ref; acc[2] += t_op
            print(f"{name:10} {m:4} {ideal:7.1f} {t_ref:9.1f} {t_op:10.1f} {t_op / t_ref:6.2f}")
        del ws
        torch.cuda.empty_cache()
    print(f"\n{'layer':6} {'rows':>4} {'ideal':>7} {'F.linear':>9} {'linear_op':>10} {'ratio':>6}  (4 projections, us)")
    for (tp, m), (ideal, t_ref, t_op) in sums.items():
        print(f"{tp:6} {m:4} {ideal:7.1f} {t_ref:9.1f} {t_op:10.1f} {t_op / t_ref:6.2f}")


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
