"""Timing of the MXFP4 routed-experts op (`fused_experts_mxfp4`) at gpt-oss-120b's expert shape
(128 experts, 4 per token, hidden 2880, intermediate 2880, biases, gpt-oss's activation), on one
GPU, against (a) the bf16 op (`fused_experts`) on the same weights dequantized and (b) the
roofline of the bytes as stored: the blocks, scales and biases of the experts the batch chose
(4.25 bits a weight) over the copy bandwidth measured in the same run, or the tensor-core FLOPs
of k experts a token at the bf16 product rate measured in the same run, whichever is longer.

    python -m kernels.bench.moe_mxfp4            # 1, 64 and 1024 tokens
    python -m kernels.bench.moe_mxfp4 --sweep    # also a grid of tiles a point, the best first
    python -m kernels.bench.moe_mxfp4 --sweep --way decode --tokens 1024   # the other way, one point
    python -m kernels.bench.moe_mxfp4 --tokens 1 2 4 8 --gemv-sweep 1      # the GEMVs' tiles at 1 token
    python -m kernels.bench.moe_mxfp4 --tokens 48 64 128 --tile-sweep 64   # the tile GEMVs' tiles

Both ways of dequantizing in the grouped GEMMs are timed: "dot_scaled" (`tl.dot_scaled`, the
default for bf16) and "decode" (the kernel's own integer decode); up to GEMV_MAX_TOKENS tokens also
"gemv", the path the op takes there, and at every point "tile", the tile GEMVs (each expert's
weights decoded once for a tile's pairs) with the rule's tiles. Routing is uniform (random logits, top-k, softmax over
the k). Everything runs in CUDA graphs (as the engine's decode does); `triton.testing.do_bench`
medians, cold L2. Each point's output is checked against the bf16 op's (relative error < 2e-2).
"""
from __future__ import annotations

import argparse
import functools
import itertools

import torch

from kernels.activation import swiglu_oai_and_mul
from kernels.bench.moe import graph_us
from kernels.fused_moe import fused_experts
from kernels.fused_moe_mxfp4 import (GEMV_MAX_TOKENS, MXFP4_BLOCK, TILE_GEMV_MAX_ROWS, MXFP4Weight, SwigluOAI,
                                     _gemv_mxfp4, _words, dequantize_mxfp4, fused_experts_mxfp4, mxfp4_config)

SHAPE = (128, 4, 2880, 2880)  # gpt-oss-120b: experts, per token, hidden, intermediate
TOKENS = (1, 64, 1024)
ACT = SwigluOAI(alpha=1.702, limit=7.0)
# The sweep keeps the rule's row tile of each point (its band) and varies the rest.
SWEEP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
         for n, k, w, s in itertools.product((32, 64, 128), (64, 128, 256), (2, 4, 8), (3, 4))]


def mxfp4_weight(e: int, n: int, k: int, g: torch.Generator) -> MXFP4Weight:
    """Random bytes and scales that keep outputs O(1): an e2m1 value is ~2.5 in size, 2^-s scales
    it to ~k^-1/2."""
    s = 127 - round(torch.log2(torch.tensor(2.5 * k ** 0.5)).item())
    return MXFP4Weight(torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda", generator=g),
                       torch.randint(s - 1, s + 2, (e, n, k // MXFP4_BLOCK), dtype=torch.uint8, device="cuda",
                                     generator=g))


def stored_bytes(w13: MXFP4Weight, w2: MXFP4Weight, b13: torch.Tensor, b2: torch.Tensor) -> int:
    """One expert's bytes as stored."""
    return sum(t[0].numel() * t.element_size() for t in (w13.blocks, w13.scales, w2.blocks, w2.scales, b13, b2))


def main(argv: list[str] | None = None) -> int:
    from kernels.bench.roofline import copy_bandwidth, matmul_rate
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--sweep", action="store_true", help="also time a grid of tiles at each point (slow)")
    p.add_argument("--way", choices=["scaled", "decode"], default="scaled",
                   help="the way --sweep times: tl.dot_scaled or the kernel's own decode (default: %(default)s)")
    p.add_argument("--gemv-sweep", type=int, nargs="*", default=[], help="token counts to time GEMV tiles at")
    p.add_argument("--tile-sweep", type=int, nargs="*", default=[], help="token counts to time tile GEMV tiles at")
    args = p.parse_args(argv)
    bw, rate = copy_bandwidth("cuda"), matmul_rate("cuda")
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s, bf16 products {rate / 1e12:.0f} TFLOP/s "
          f"(same run); gpt-oss-120b experts {SHAPE}")
    e, k, h, inter = SHAPE
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = mxfp4_weight(e, 2 * inter, h, g), mxfp4_weight(e, h, inter, g)
    b13 = torch.randn(e, 2 * inter, device="cuda", generator=g).to(torch.bfloat16) * 0.1
    b2 = torch.randn(e, h, device="cuda", generator=g).to(torch.bfloat16) * 0.1
    # The bf16 op's layout: gate rows, then up rows (ours keeps them interleaved), its own activation launch.
    dense13 = dequantize_mxfp4(w13.blocks, w13.scales, torch.bfloat16)
    dense13 = torch.cat([dense13[:, 0::2], dense13[:, 1::2]], 1).contiguous()
    dense_b13 = torch.cat([b13[:, 0::2], b13[:, 1::2]], 1).contiguous()
    dense2 = dequantize_mxfp4(w2.blocks, w2.scales, torch.bfloat16)
    dense_act = functools.partial(swiglu_oai_and_mul, alpha=ACT.alpha, limit=ACT.limit)
    per_expert = stored_bytes(w13, w2, b13, b2)
    print(f"{'tokens':>6} {'experts':>7} {'MB read':>8} {'roofline':>9} {'dot_scaled':>10} {'decode':>8} {'gemv':>8} "
          f"{'tile':>8} {'bf16':>8} {'x roof':>6} {'vs bf16':>7}   (us; x roof and vs bf16 of the fastest MXFP4 way)")
    for t in args.tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        top, ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=1)
        weights = torch.softmax(top, dim=1).to(torch.bfloat16)
        dense = lambda: fused_experts(x, dense13, dense2, weights, ids, dense_act, dense_b13, b2)  # noqa: E731
        grouped = mxfp4_config(t * k, e, tile_gemv=False)
        ways = {sd: functools.partial(fused_experts_mxfp4, x, w13, w2, weights, ids, ACT, b13, b2, scaled_dot=sd,
                                      config=grouped) for sd in (True, False)}
        if t <= GEMV_MAX_TOKENS:
            ways["gemv"] = functools.partial(fused_experts_mxfp4, x, w13, w2, weights, ids, ACT, b13, b2)
        tile = mxfp4_config(TILE_GEMV_MAX_ROWS * e, e)  # the rule's tile GEMVs, also where it takes another path
        ways["tile"] = functools.partial(fused_experts_mxfp4, x, w13, w2, weights, ids, ACT, b13, b2, config=tile)
        want = dense().float()
        for sd, run in ways.items():
            err = ((run().float() - want).norm() / want.norm()).item()
            assert err < 2e-2, f"T={t} {sd}: relative error {err:.3g} against the bf16 op"
        used = ids.unique().numel()
        nbytes = used * per_expert + 2 * t * h * 2
        roof = max(nbytes / bw, 2 * t * k * 3 * inter * h / rate) * 1e6
        times = {sd: graph_us(run) for sd, run in ways.items()}
        t_dense = graph_us(dense)
        best = min(times.values())
        gemv = f"{times['gemv']:8.1f}" if "gemv" in times else f"{'-':>8}"
        print(f"{t:6} {used:7} {nbytes / 1e6:8.1f} {roof:9.1f} {times[True]:10.1f} {times[False]:8.1f} {gemv} "
              f"{times['tile']:8.1f} {t_dense:8.1f} {best / roof:6.2f} {t_dense / best:6.2f}x")
        if t in args.gemv_sweep:
            gemv_sweep(x, w13, w2, weights, ids, b13, b2)
        if t in args.tile_sweep:
            tile_sweep(ways["tile"], want)
        if args.sweep:
            sweep(t, e, ways[args.way == "scaled"], times[args.way == "scaled"])
    return 0


GEMV_SWEEP = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w)
              for n, k, w in itertools.product((4, 8, 16), (1024,), (1, 2, 4, 8))]


def gemv_sweep(x, w13, w2, weights, ids, b13, b2) -> None:
    """Every tile of GEMV_SWEEP for each of the GEMV path's two launches; the four fastest."""
    t, k = ids.shape
    flat, routed = ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous()
    inter = torch.randn(t * k, w2.shape[2], device="cuda", dtype=torch.bfloat16)
    out = torch.empty(t, w2.shape[1], device="cuda", dtype=torch.bfloat16)
    launches = {"gate_up": lambda cfg: _gemv_mxfp4(x, w13, _words(w13), b13, flat, inter, None, 1, k, ACT, cfg),
                "down": lambda cfg: _gemv_mxfp4(inter, w2, _words(w2), b2, flat, out, routed, k, 1, config=cfg,
                                                ids_early=True)}
    for name, launch in launches.items():
        results = []
        for cfg in GEMV_SWEEP:
            try:
                results.append((graph_us(functools.partial(launch, cfg)), cfg))
            except Exception as err:  # noqa: BLE001 (tiles that do not fit registers)
                print(f"    skipped {cfg}: {type(err).__name__}")
        results.sort(key=lambda r: r[0])
        for us, cfg in results[:4]:
            print(f"    {name:8} {us:8.1f} us  {cfg}")


TILE_SWEEP = [dict(TILE_GEMV=True, BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=w)
              for m, n, k, w in itertools.product((1, 2, 4), (32, 64, 128), (128, 256), (2, 4))]


def tile_sweep(run, want: torch.Tensor) -> None:
    """The whole op (alignment, both launches, the sum) with every tile of TILE_SWEEP; the six
    fastest, each checked against the bf16 op."""
    results = []
    for cfg in TILE_SWEEP:
        try:
            err = ((run(config=cfg).float() - want).norm() / want.norm()).item()
            assert err < 2e-2, f"{cfg}: relative error {err:.3g} against the bf16 op"
            results.append((graph_us(functools.partial(run, config=cfg)), cfg))
        except Exception as err:  # noqa: BLE001 (tiles that do not fit registers)
            print(f"    skipped {cfg}: {type(err).__name__}: {str(err)[:80]}")
    results.sort(key=lambda r: r[0])
    for us, cfg in results[:6]:
        print(f"    tile {us:8.1f} us  {cfg}")


def sweep(t: int, e: int, run, shipped: float) -> None:
    """Every tile of SWEEP (with the rule's BLOCK_M) that compiles; the five fastest against the
    shipped rule's."""
    results = []
    block_m = mxfp4_config(t * SHAPE[1], e, tile_gemv=False)["BLOCK_M"]
    for tiles in SWEEP:
        cfg = dict(tiles, BLOCK_M=block_m)
        try:
            results.append((graph_us(functools.partial(run, config=cfg)), cfg))
        except Exception as err:  # noqa: BLE001 (tiles that do not fit shared memory or registers)
            print(f"    skipped {cfg}: {type(err).__name__}")
    results.sort(key=lambda r: r[0])
    print(f"    shipped rule {mxfp4_config(t * SHAPE[1], e, tile_gemv=False)}: {shipped:.1f} us; fastest:")
    for us, cfg in results[:5]:
        print(f"    {us:8.1f} us  {cfg}")

if __name__ == "__main__":
    raise SystemExit(main())
