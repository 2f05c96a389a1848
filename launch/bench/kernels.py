"""`distengine bench kernels`: the paged attention kernel on a GPU against torch SDPA and the copy
bandwidth, measured in one run (CUDA events through triton.testing.do_bench: median of many,
L2 cleared between runs).

Decode reports TB/s of K/V read (the bytes each query must read once); prefill reports TFLOP/s
of causal attention (4 x Hq x D x L^2 / 2). SDPA runs the flash backend on the same data laid out
contiguously ([B, H, L, D]). `--sweep` also times a set of tile configurations per case and
reports the best, to choose the defaults in `kernels.paged_attention.default_config`.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

torch = None  # imported by run(): `distengine --help` must not load it

DECODE_CASES = [  # (batch, context, sliding window)
    (64, 4096, 0), (128, 2048, 0), (8, 32768, 0), (1, 8192, 0), (64, 1024, 0), (64, 32768, 1024)]
PREFILL_CASES = [(4096, 128), (16384, 128), (4096, 256), (16384, 256)]  # (length, head dim)
HQ, HKV, BLOCK = 32, 8, 16


def _bench(fn, reps_ms: int = 200) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=reps_ms, return_mode="median")


def copy_bandwidth() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _bench(lambda: y.copy_(x))
    return 2 * x.numel() / (ms / 1e3) / 1e12


def _paged(batch: int, length: int, head_dim: int, q_len: int, g: torch.Generator):
    """Random K/V in a shuffled paged cache plus the same K/V contiguous for SDPA."""
    blocks_per_seq = math.ceil(length / BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    k = torch.randn(batch, HKV, length, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1
    table = perm.view(batch, blocks_per_seq).to(torch.int32)
    kv = torch.empty(num_blocks, 2, BLOCK, HKV, head_dim, device="cuda", dtype=torch.bfloat16)
    pad = blocks_per_seq * BLOCK - length
    for name, src, idx in (("k", k, 0), ("v", v, 1)):
        t = torch.nn.functional.pad(src, (0, 0, 0, pad)).view(batch, HKV, blocks_per_seq, BLOCK, head_dim)
        kv[table.long().flatten(), idx] = t.permute(0, 2, 3, 1, 4).reshape(-1, BLOCK, HKV, head_dim)
    q = torch.randn(batch * q_len, HQ, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    qsl = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
    lens = torch.full((batch,), length, device="cuda", dtype=torch.int32)
    return q, kv, table, qsl, lens, k, v


def _sdpa(q4, k, v, causal: bool, window: int = 0, flash: bool = True):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    if window:
        return None  # SDPA has no sliding window without a dense mask
    if not flash:  # what torch picks by itself (the shared baseline's figure)
        return (lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=causal, enable_gqa=True)), "auto"
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q4, k, v, is_causal=causal, enable_gqa=True)
        backend = "flash"
    except RuntimeError:
        backend = "default"

    def run():
        if backend == "flash":
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q4, k, v, is_causal=causal, enable_gqa=True)
        return F.scaled_dot_product_attention(q4, k, v, is_causal=causal, enable_gqa=True)
    return run, backend


def _decode_configs():
    for tile in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3):
                yield {"BLOCK_M": 16, "TILE_N": tile, "num_warps": warps, "num_stages": stages}


def _prefill_configs(head_dim: int):
    for bm in (64, 128):
        for tile in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3):
                    yield {"BLOCK_M": bm, "TILE_N": tile, "num_warps": warps, "num_stages": stages}


def bench_decode(sweep: bool, log) -> list[dict]:
    from kernels.paged_attention import choose_num_splits, default_config, paged_attention
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for batch, length, window in DECODE_CASES:
        q, kv, table, qsl, lens, k, v = _paged(batch, length, 128, 1, g)
        read = min(length, window) if window else length
        nbytes = batch * HKV * read * 128 * 2 * 2

        def ours(cfg=None, splits=None):
            return lambda: paged_attention(q, kv, table, qsl, lens, 1, length, 128 ** -0.5, sliding_window=window,
                                           config=cfg, num_splits=splits)
        ms = _bench(ours())
        row = {"case": f"decode B={batch} L={length}" + (f" W={window}" if window else ""), "ms": ms,
               "TB/s": nbytes / ms / 1e9, "splits": choose_num_splits(batch, HKV, length, sms),
               "config": default_config(1, 128, HQ // HKV, BLOCK, window)}
        sd = _sdpa(q.view(batch, 1, HQ, 128).transpose(1, 2), k, v, causal=False, window=window)
        if sd:
            run, backend = sd
            sms_ = _bench(run)
            row.update({"sdpa_ms": sms_, "sdpa_TB/s": nbytes / sms_ / 1e9, "vs_sdpa": sms_ / ms, "sdpa": backend})
            run, _ = _sdpa(q.view(batch, 1, HQ, 128).transpose(1, 2), k, v, causal=False, flash=False)
            auto = _bench(run)
            row.update({"sdpa_auto_ms": auto, "vs_sdpa_auto": auto / ms})
        if sweep:
            best = (ms, row["config"], row["splits"])
            split_opts = [None] + ([8, 16, 32] if batch * HKV < sms else [])
            for cfg in _decode_configs():
                for sp in split_opts:
                    try:
                        t = _bench(ours(cfg, sp), 60)
                    except Exception as e:  # a config that does not compile (resources)
                        log(f"skip {cfg} {sp}: {type(e).__name__}")
                        continue
                    if t < best[0]:
                        best = (t, cfg, sp)
            row.update({"best_ms": best[0], "best_TB/s": nbytes / best[0] / 1e9, "best_config": best[1],
                        "best_splits": best[2]})
        log(json.dumps(row))
        rows.append(row)
        q = kv = k = v = None  # free before the next case
        torch.cuda.empty_cache()
    return rows


def bench_prefill(sweep: bool, log) -> list[dict]:
    from kernels.paged_attention import default_config, paged_attention
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    for length, head_dim in PREFILL_CASES:
        q, kv, table, qsl, lens, k, v = _paged(1, length, head_dim, length, g)
        flops = 4 * HQ * head_dim * length * length / 2

        def ours(cfg=None):
            return lambda: paged_attention(q, kv, table, qsl, lens, length, length, head_dim ** -0.5, config=cfg)
        ms = _bench(ours())
        row = {"case": f"prefill L={length} D={head_dim}", "ms": ms, "TFLOP/s": flops / ms / 1e9,
               "config": default_config(length, head_dim, HQ // HKV, BLOCK)}
        run, backend = _sdpa(q.view(1, length, HQ, head_dim).transpose(1, 2), k, v, causal=True)
        sms_ = _bench(run)
        row.update({"sdpa_ms": sms_, "sdpa_TFLOP/s": flops / sms_ / 1e9, "vs_sdpa": sms_ / ms, "sdpa": backend})
        if sweep:
            best = (ms, row["config"])
            for cfg in _prefill_configs(head_dim):
                try:
                    t = _bench(ours(cfg), 60)
                except Exception as e:
                    log(f"skip {cfg}: {type(e).__name__}")
                    continue
                if t < best[0]:
                    best = (t, cfg)
            row.update({"best_ms": best[0], "best_TFLOP/s": flops / best[0] / 1e9, "best_config": best[1]})
        log(json.dumps(row))
        rows.append(row)
        q = kv = k = v = None  # free before the next case
        torch.cuda.empty_cache()
    return rows


def check_correctness(log) -> float:
    """Largest relative error of the kernel against the float64 reference on random mixed
    batches (GPU, bf16), before any timing."""
    from kernels.paged_attention import paged_attention
    from kernels.paged_attention_ref import paged_attention_ref
    worst = 0.0
    g = torch.Generator(device="cuda").manual_seed(2)
    for length, q_len, window in ((3000, 1, 0), (3000, 1, 1024), (2048, 2048, 0), (5000, 700, 512)):
        q, kv, table, qsl, lens, k, v = _paged(2, length, 128, q_len, g)
        out = torch.full_like(q, float("nan"))
        paged_attention(q, kv, table, qsl, lens, q_len, length, 128 ** -0.5, sliding_window=window, out=out)
        ref = paged_attention_ref(q.double(), kv.double(), table, qsl, lens, scale=128 ** -0.5, sliding_window=window)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(out).all() and err < 1e-2, (length, q_len, window, err)
        worst = max(worst, err)
    log(f"correctness: worst relative error {worst:.2e}")
    return worst


def add_arguments(p) -> None:
    p.add_argument("--sweep", action="store_true", help="also time tile configurations and report the best")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for the JSON results and log")
    p.add_argument("--skip-prefill", action="store_true", help="decode cases only")


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="distengine bench kernels")
    add_arguments(p)
    return run(p.parse_args(argv))


def run(args) -> int:
    global torch
    import torch
    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "bench_kernels.log"), "a")

    def log(msg: str) -> None:
        print(msg, file=logf, flush=True)

    t0 = time.time()
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    import triton
    results["triton"] = triton.__version__
    results["copy_TB/s"] = copy_bandwidth()
    results["max_rel_err"] = check_correctness(log)
    results["decode"] = bench_decode(args.sweep, log)
    if not args.skip_prefill:
        results["prefill"] = bench_prefill(args.sweep, log)
    try:
        from kernels.bench.layer_ops import bench_layer_ops
        results["layer_ops"] = bench_layer_ops("cuda")
    except ImportError:
        pass
    results["seconds"] = time.time() - t0
    with open(os.path.join(args.out, "bench_kernels.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    copy = results["copy_TB/s"]
    print(f"{results['gpu']}  torch {results['torch']}  triton {results['triton']}  copy {copy:.2f} TB/s  "
          f"max rel err {results['max_rel_err']:.1e}")
    print(f"{'case':34s} {'ms':>8s} {'TB/s|TF':>8s} {'%copy':>6s} {'sdpa ms':>8s} {'sdpa':>8s} {'x sdpa':>7s} "
          f"{'x auto':>7s}  best")
    for r in results["decode"]:
        best = f"{r['best_ms']:.3f} ms {r['best_TB/s']:.2f} {r['best_config']} s={r['best_splits']}" if "best_ms" in r else ""
        print(f"{r['case']:34s} {r['ms']:8.3f} {r['TB/s']:8.2f} {100 * r['TB/s'] / copy:5.0f}% "
              f"{r.get('sdpa_ms', float('nan')):8.3f} {r.get('sdpa_TB/s', float('nan')):8.2f} "
              f"{r.get('vs_sdpa', float('nan')):7.2f} {r.get('vs_sdpa_auto', float('nan')):7.2f}  {best}")
    for r in results.get("prefill", []):
        best = f"{r['best_ms']:.3f} ms {r['best_TFLOP/s']:.0f} {r['best_config']}" if "best_ms" in r else ""
        print(f"{r['case']:34s} {r['ms']:8.3f} {r['TFLOP/s']:8.1f} {'':6s} {r['sdpa_ms']:8.3f} "
              f"{r['sdpa_TFLOP/s']:8.1f} {r['vs_sdpa']:7.2f} {'':7s}  {best}")
    for r in results.get("layer_ops", []):
        print(f"{r['op']:20s} {r['shape']:28s} ours {r['ours_us']:7.1f} us {r['gbps']:6.0f} GB/s | torch bf16 "
              f"{r['torch_us']:7.1f} us ({r['speedup']:.2f}x) | fp32 ref {r['ref_us']:7.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
