"""Timing of the routed-experts op (`fused_experts`) at published MoE shapes, on one GPU, against
(a) the HBM roofline of the experts a batch touches (their weight bytes over the copy bandwidth
measured in the same run; past a few hundred tokens the tensor-core FLOPs of k experts per
token at the product rate measured in the same run) and (b) a plain bf16 torch loop over the
chosen experts (transformers' eager experts: gather, two products, index_add).

    python -m kernels.bench.moe            # the experts, then the routers
    python -m kernels.bench.moe --router   # the routers alone
    python -m kernels.bench.moe --few        # GEMVs against grouped GEMMs at 1-8 tokens
    python -m kernels.bench.moe --gemv-sweep

A few tokens through narrow experts run as GEMVs (`kernels.moe_gemv.takes`). `--few` times
the GEMVs (forced where the op would not take them) against the grouped GEMMs (their tiles
forced) at 1-8 tokens as a decode step runs them: REPS calls back to back in one CUDA graph,
each with its own routing (so each reads its own experts, mostly not in the L2); `--gemv-sweep`
times the GEMVs' tiles at one token.

Routing is uniform (random logits, top-k, softmax over the k), as random router weights give.
Ours runs inside a CUDA graph (as the engine's decode does) and eagerly; the torch loop eagerly
(its shapes depend on the routing). The alignment on its own (pairs sorted by expert, in CUDA
graphs): the one-program Triton kernel against the torch ops. `triton.testing.do_bench` medians,
cold L2.

The grouped sigmoid router (`topk_sigmoid_grouped`, DeepSeek-V3's rule: Nemotron-H) against its
torch ops (`topk_sigmoid_grouped_ref`, a dozen small launches), each as a decode step runs it:
REPS calls back to back in one CUDA graph (`kernels.bench.graph_timing`), microseconds a call.
"""
from __future__ import annotations

import torch
import triton

from kernels.activation import silu_and_mul
from kernels.fused_moe import ALIGN_KERNEL_MAX_PAIRS, fused_experts, moe_align_kernel, moe_align_torch, moe_config
from kernels.moe_gemv import experts_gemv, moe_gemv_config, takes
from kernels.moe_routing import topk_sigmoid_grouped, topk_sigmoid_grouped_ref

# name: (experts, per token, hidden, expert intermediate)
SHAPES = {"granite-4.0-h-tiny": (64, 6, 1536, 512), "granite-4.0-h-small": (72, 10, 4096, 768),
          "gpt-oss-20b (bf16)": (32, 4, 2880, 2880), "qwen3.6-35b-a3b": (256, 8, 2048, 512)}
TOKENS = (1, 2, 4, 8, 32, 128, 256, 1024)
# The GEMV tiles `--gemv-sweep` times, for each launch with the other's default: (weight tile
# elements, warps), the tile's columns following from the elements as `moe_gemv_config`'s do.
GEMV_TILES = [(e, w) for e in (4096, 8192, 16384, 32768) for w in (2, 4, 8)]


def torch_loop(x, w13, w2, weights, ids):
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for e in ids.unique().tolist():
        tok, j = (ids == e).nonzero(as_tuple=True)
        h = torch.nn.functional.linear(x[tok], w13[e])
        h = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, torch.nn.functional.linear(h, w2[e]) * weights[tok, j, None])
    return out


def graph_us(fn) -> float:
    from triton.testing import do_bench
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return do_bench(graph.replay) * 1e3


def expert_weights(e: int, h: int, inter: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 experts of a shape, (w13 [E, 2I, H], w2 [E, H, I]), scaled to keep outputs O(1)."""
    w13 = torch.randn(e, 2 * inter, h, device="cuda", dtype=torch.bfloat16, generator=g) * h ** -0.5
    w2 = torch.randn(e, h, inter, device="cuda", dtype=torch.bfloat16, generator=g) * inter ** -0.5
    return w13, w2


def time_shape(name: str, shape: tuple[int, int, int, int], bw: float, rate: float, g: torch.Generator) -> None:
    """One row per token count of TOKENS. A function of its own so that the shape's experts (and
    the timed closures over them) are freed when it returns, before the next shape's."""
    from triton.testing import do_bench
    e, k, h, inter = shape
    w13, w2 = expert_weights(e, h, inter, g)
    for t in TOKENS:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        top, ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=1)
        weights = torch.softmax(top, dim=1).to(torch.bfloat16)
        run = lambda: fused_experts(x, w13, w2, weights, ids, silu_and_mul)  # noqa: E731
        err = (run().float() - torch_loop(x, w13, w2, weights, ids).float()).norm() / \
            torch_loop(x, w13, w2, weights, ids).float().norm()
        assert err < 2e-2, f"{name} T={t}: relative error {err:.3g}"
        used = ids.unique().numel()
        nbytes = used * 3 * inter * h * 2 + 2 * t * h * 2
        roof = max(nbytes / bw, 2 * t * k * 3 * inter * h / rate) * 1e6
        t_graph = graph_us(run)
        t_eager = do_bench(run) * 1e3
        t_loop = do_bench(lambda: torch_loop(x, w13, w2, weights, ids)) * 1e3
        bm = moe_config(t * k, e)["BLOCK_M"]
        a_torch = graph_us(lambda: moe_align_torch(ids, e, bm))
        a_kernel = graph_us(lambda: moe_align_kernel(ids, e, bm)) if t * k <= ALIGN_KERNEL_MAX_PAIRS \
            else float("nan")
        print(f"{name:20} {t:6} {used:7} {nbytes / 1e6:8.1f} {roof:9.1f} {t_graph:8.1f} {t_eager:8.1f} "
              f"{t_loop:8.1f} {t_graph / roof:6.2f} {t_loop / t_graph:7.1f}x {a_kernel:6.1f} {a_torch:6.1f}")


def gemv_sweep(name: str, shape: tuple[int, int, int, int], bw: float, g: torch.Generator) -> None:
    """One token's experts with each of GEMV_TILES in one launch (the other at its default), in
    CUDA graphs, against the roofline."""
    e, k, h, inter = shape
    w13, w2 = expert_weights(e, h, inter, g)
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16, generator=g)
    top, ids = torch.rand(1, e, device="cuda", generator=g).topk(k, dim=1)
    weights = torch.softmax(top, dim=1).to(torch.bfloat16)
    roof = (k * 3 * inter * h * 2 + 2 * h * 2) / bw * 1e6
    want = fused_experts(x, w13, w2, weights, ids, silu_and_mul)
    default = (moe_gemv_config(h, 1, 2, 2), moe_gemv_config(inter, k, 1, 2))
    print(f"{name}: one token, us (roofline {roof:.1f}); defaults {default}")
    for launch in (0, 1):
        for elements, warps in GEMV_TILES:
            cfg = dict(default[launch], num_warps=warps)
            slots, halves = (1, 2) if launch == 0 else (triton.next_power_of_2(k), 1)
            cfg["BLOCK_N"] = max(1, elements // (slots * cfg["BLOCK_K"]) // halves)
            cfgs = (cfg, default[1]) if launch == 0 else (default[0], cfg)
            run = lambda cfgs=cfgs: experts_gemv(x, w13, w2, weights, ids, silu_and_mul, (0, True), None,  # noqa: E731
                                                 None, False, cfgs)
            err = ((run().float() - want.float()).norm() / want.float().norm()).item()
            print(f"  {'gate/up' if launch == 0 else 'down':7} {cfg['BLOCK_N']:3} x {cfg['BLOCK_K']:4} on {warps} warps "
                  f"{graph_us(run):8.1f}  (relative difference {err:.1e})")


FEW_TOKENS = (1, 2, 4, 8)


def time_few(name: str, shape: tuple[int, int, int, int], bw: float, g: torch.Generator) -> None:
    from kernels.bench.graph_timing import REPS, graph_time_us
    e, k, h, inter = shape
    w13, w2 = expert_weights(e, h, inter, g)
    for t in FEW_TOKENS:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=g)
        routes = []
        for _ in range(REPS):
            top, ids = torch.rand(t, e, device="cuda", generator=g).topk(k, dim=1)
            routes.append((torch.softmax(top, dim=1).to(torch.bfloat16), ids))
        cfg = moe_config(t * k, e)
        gemv_fn = [lambda r=r: experts_gemv(x, w13, w2, *r, silu_and_mul, (0, True), None, None, False) for r in routes]
        grouped_fn = [lambda r=r: fused_experts(x, w13, w2, *r, silu_and_mul, config=cfg) for r in routes]
        a, b = gemv_fn[0](), grouped_fn[0]()
        err = ((a.float() - b.float()).norm() / b.float().norm()).item()
        used = sum(r[1].unique().numel() for r in routes) / REPS
        roof = (used * 3 * inter * h * 2 + 2 * t * h * 2) / bw * 1e6
        print(f"{name:20} {t:6} {used:7.1f} {roof:9.1f} {graph_time_us(gemv_fn):8.1f} {graph_time_us(grouped_fn):8.1f}"
              f"   (the op takes the {'GEMVs' if takes(t, inter) else 'grouped GEMMs'}; difference {err:.1e})")


def time_routers() -> None:
    from kernels.bench.graph_timing import REPS, graph_time_us
    print(f"{'router':30} {'tokens':>6} {'kernel':>8} {'torch':>8}   (us a call, {REPS} calls in a CUDA graph)")
    g = torch.Generator(device="cuda").manual_seed(1)
    for name, (e, k, n_group, topk_group, shared) in ROUTERS.items():
        # Distinct multiples of 1/64 (no near-ties for the two sigmoids' last bits to split).
        bias = torch.randint(-8, 9, (e,), device="cuda", generator=g) / 64
        for t in ROUTER_TOKENS:
            logits = torch.rand(REPS, t, e, device="cuda", generator=g).argsort(dim=-1).float().sub(e / 2).div(64)
            args = (k, n_group, topk_group, True, 2.5, torch.bfloat16, shared)
            got, want = topk_sigmoid_grouped(logits[0], bias, *args), topk_sigmoid_grouped_ref(logits[0], bias, *args)
            assert torch.equal(got[1], want[1]), f"{name} T={t}: the kernel's choice differs from torch's"
            ours = graph_time_us([lambda x=x: topk_sigmoid_grouped(x, bias, *args) for x in logits])
            ref = graph_time_us([lambda x=x: topk_sigmoid_grouped_ref(x, bias, *args) for x in logits])
            print(f"{name:30} {t:6} {ours:8.2f} {ref:8.2f}")
    time_router_gemv()


# Nemotron-3-Nano's router: fp32 [128, 2688] against a bf16 row; tiles (BLOCK_N, BLOCK_K, warps, stages).
ROUTER_GEMV = (128, 2688)
ROUTER_GEMV_CONFIGS = [(16, 1024, 8, 1), (4, 1024, 4, 1), (2, 1024, 4, 1), (1, 1024, 4, 1), (2, 2048, 8, 1),
                       (1, 4096, 8, 1)]


def time_router_gemv() -> None:
    """The router's product at one row, as 64 calls on their own weights in a CUDA graph (88 MB,
    past the L2, as 23 routers among the model's other weights are): x.float() then the fp32 GEMV
    (two launches), the GEMV widening the bf16 row itself (one), and its tiles."""
    from kernels.bench.graph_timing import graph_time_us
    from kernels.gemv import gemv, gemv_config
    n, k = ROUTER_GEMV
    ws = [torch.randn(n, k, device="cuda") * 0.02 for _ in range(64)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(gemv(x, ws[0]), gemv(x.float(), ws[0]))
    print(f"router GEMV [{n}, {k}] fp32, one bf16 row (default tiles {gemv_config(n, k)}): us a call")
    print(f"  x.float() + gemv  {graph_time_us([lambda w=w: gemv(x.float(), w) for w in ws]):8.2f}")
    print(f"  gemv (widening)   {graph_time_us([lambda w=w: gemv(x, w) for w in ws]):8.2f}")
    for bn, bk, warps, stages in ROUTER_GEMV_CONFIGS:
        cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
        us = graph_time_us([lambda w=w, cfg=cfg: gemv(x, w, config=cfg) for w in ws])
        print(f"  tiles {bn:2} x {bk:4}, {warps} warps {us:8.2f}")


def main() -> int:
    import sys
    if "--router" in sys.argv[1:]:
        time_routers()
        return 0
    from kernels.bench.roofline import copy_bandwidth, matmul_rate
    bw, rate = copy_bandwidth("cuda"), matmul_rate("cuda")
    few = {"--few": time_few, "--gemv-sweep": gemv_sweep}
    mode = next((few[a] for a in sys.argv[1:] if a in few), None)
    if mode is not None:
        print(f"copy {bw / 1e12:.2f} TB/s (same run)")
        if mode is time_few:
            print(f"{'shape':20} {'tokens':>6} {'experts':>7} {'roofline':>9} {'GEMVs':>8} {'grouped':>8}   (us a call)")
        g = torch.Generator(device="cuda").manual_seed(0)
        for name, shape in SHAPES.items():
            mode(name, shape, bw, g)
            torch.cuda.empty_cache()
        return 0
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 products {rate / 1e12:.0f} TFLOP/s (same run)")
    print(f"{'shape':20} {'tokens':>6} {'experts':>7} {'MB read':>8} {'roofline':>9} {'graph':>8} {'eager':>8} "
          f"{'torch':>8} {'x roof':>6} {'vs torch':>8} {'align':>6} {'torch':>6}   (us)")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, shape in SHAPES.items():
        time_shape(name, shape, bw, rate, g)
        torch.cuda.empty_cache()
    time_routers()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
