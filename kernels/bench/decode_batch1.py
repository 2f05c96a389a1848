"""On a GPU: the batch-1 decode step's pieces timed inside CUDA graphs, as the engine runs them.

Each case is captured as a graph of REPS calls, each on its own weights / cache (Gemma-3-12B's
shapes, so nothing stays in L2 between calls, as in a 48-layer model), replayed, timed with CUDA
events; per-call time = graph time / REPS (launch gaps included, as in the real step:
`kernels.bench.graph_timing`).

    python -m kernels.bench.decode_batch1
"""
from __future__ import annotations

import math

import torch

from kernels.bench.graph_timing import REPS, graph_time_us
from kernels.bench.roofline import copy_bandwidth
from kernels.gemv import gemv
from kernels.paged_attention import default_config, paged_attention

CONFIGS = [(4, 256, 4, 3), (8, 256, 4, 1), (8, 512, 4, 1), (16, 512, 8, 1), (16, 1024, 8, 1), (32, 1024, 8, 1)]
# Gemma-3-12B's projections at TP=1 and their shards at TP=2, and the (tied) LM head.
SHAPES = {"qkv": (8192, 3840), "o_proj": (3840, 4096), "gate_up": (30720, 3840), "down": (3840, 15360),
          "qkv/2": (4096, 3840), "o_proj/2": (3840, 2048), "gate_up/2": (15360, 3840), "down/2": (3840, 7680),
          "lm_head": (262208, 3840)}


def main() -> int:
    dt, dev = torch.bfloat16, "cuda"
    bw = copy_bandwidth("cuda")
    print(f"copy {bw / 1e12:.2f} TB/s")
    rows = []
    for name, (N, K) in SHAPES.items():
        reps = 4 if name == "lm_head" else REPS
        ws = [torch.randn(N, K, device=dev, dtype=dt) * 0.02 for _ in range(reps)]
        x = torch.randn(1, K, device=dev, dtype=dt)
        ys = [torch.empty(1, N, device=dev, dtype=dt) for _ in range(reps)]
        ideal = N * K * 2 / bw * 1e6
        ref = torch.nn.functional.linear(x.float(), ws[0].float())
        rows.append((name, "F.linear", graph_time_us(
            [lambda w=w, y=y: torch.nn.functional.linear(x, w, out=y) for w, y in zip(ws, ys)]), ideal))
        cands = [("gemv (shipped rule)", None)] + [(f"gemv {c}", dict(zip(("BLOCK_N", "BLOCK_K", "num_warps",
                                                                            "num_stages"), c))) for c in CONFIGS]
        for label, cfg in cands:
            y = gemv(x, ws[0], out=ys[0], config=cfg)
            err = (y.float() - ref).abs().max().item()
            if err > 0.02 * ref.abs().max().item():
                print(f"  {name} {label}: wrong ({err})")
                continue
            rows.append((name, label, graph_time_us([lambda w=w, y=y, cfg=cfg: gemv(x, w, out=y, config=cfg)
                                                     for w, y in zip(ws, ys)]), ideal))
        del ws, ys
        torch.cuda.empty_cache()

    # attention, B=1, 16 q / 8 kv heads, D=256, block 16; "shipped" = the engine's choice for a
    # graph bounded by max_model_len = L + 128
    HQ, HKV, D, BS = 16, 8, 256, 16
    for L in (600, 2048, 8192):
        per = math.ceil(L / BS)
        caches = [torch.randn(per + 1, 2, BS, HKV, D, device=dev, dtype=dt) for _ in range(REPS)]
        table = torch.arange(1, per + 1, device=dev, dtype=torch.int32).view(1, per)
        q = torch.randn(1, HQ, D, device=dev, dtype=dt)
        qsl = torch.arange(2, device=dev, dtype=torch.int32)
        lens = torch.full((1,), L, device=dev, dtype=torch.int32)
        out = torch.empty_like(q)
        ideal = L * HKV * D * 4 / bw * 1e6
        bound = L + 128
        ref = paged_attention(q, caches[0], table, qsl, lens, 1, bound, D ** -0.5).float()
        base = default_config(1, D, 2, BS, 0, bound)
        cases = [("shipped", None, None)] + [(f"tile {t} splits {sp}", dict(base, TILE_N=t), sp)
                                             for t in (32, 64) for sp in (8, 16, 32)]
        for label, cfg, splits in cases:
            o = paged_attention(q, caches[0], table, qsl, lens, 1, bound, D ** -0.5, out=out, num_splits=splits,
                                config=cfg)
            if (o.float() - ref).abs().max().item() > 2e-2:
                print(f"  attention L={L} {label}: wrong")
                continue
            t = graph_time_us([lambda c=c, cfg=cfg, splits=splits: paged_attention(
                q, c, table, qsl, lens, 1, bound, D ** -0.5, out=out, num_splits=splits, config=cfg) for c in caches])
            rows.append((f"attn B=1 L={L}", label, t, ideal))
        del caches
    z = torch.zeros(16, device=dev)
    rows.append(("floor", "z.add_(1)", graph_time_us([lambda: z.add_(1.0) for _ in range(REPS)]), 0.0))
    print(f"\n{'op':16} {'variant':34} {'us/call':>8} {'ideal':>7} {'x ideal':>7}")
    for name, var, t, ideal in rows:
        print(f"{name:16} {var:34} {t:8.2f} {ideal:7.2f} {t / ideal if ideal else 0:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
