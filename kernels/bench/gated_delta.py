"""Timing of the Gated DeltaNet kernels at Qwen3-Next's linear-attention shape at TP 1 (Hk = 16
key heads, Hv = 32 value heads, K = V = 128; bf16 activations, fp32 states), on one GPU:

(a) gated_delta_update (decode) for batch 1/32/128, each sequence updating its state in place:
    time (triton's do_bench, and per call inside one CUDA graph as a decode step runs it, with
    enough state copies that a call does not find the previous call's states in L2), and the
    bandwidth over the state bytes (read once, written once), against the copy bandwidth measured
    in the same run (`roofline.copy_bandwidth`);
(b) gated_delta_varlen (prefill) on 1 x 8192 and 8 x 1024 tokens (zero initial states, chunks of
    64, the final state written): time, and the rate over the chunk form's useful products (per
    head and chunk of L: k k^T and q k^T 2 L^2 K each, k S, q S and k^T v_new 2 L K V each,
    P v_new 2 L^2 V, the triangular solve L^2 V; A and the solve once per head, not per column
    block) against the bf16 product rate (`roofline.matmul_rate`); the error against
    transformers' torch_chunk_gated_delta_rule (fp32 math) on the same inputs, and its time.

    python -m kernels.bench.gated_delta [--sweep]   (--sweep: also the launch configurations, the
                                                     prefill's each in a process of its own)
    python -m kernels.bench.gated_delta --config BLOCK_V,NUM_WARPS,NUM_STAGES,SPLIT   (one prefill launch)

The input builders work on any device (tests build tiny inputs on CPU).
"""
from __future__ import annotations

import sys

import torch

__all__ = ["QWEN3_NEXT", "bench_gated_delta", "decode_inputs", "hf_chunk", "prefill_flops", "prefill_inputs"]

QWEN3_NEXT = dict(Hk=16, Hv=32, K=128, V=128)


def _rnd(gen: torch.Generator, device, dtype):
    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dt)
    return rnd


def _operands(T: int, Hk: int, Hv: int, K: int, V: int, rnd) -> dict:
    """q, k, v as views of one conv output, b and a of one projection, A_log and dt_bias."""
    conv = rnd(T, 2 * Hk * K + Hv * V)
    ba = rnd(T, 2 * Hv)
    A = torch.linspace(0.05, 8.0, Hv)
    return dict(q=conv[:, :Hk * K].view(T, Hk, K), k=conv[:, Hk * K:2 * Hk * K].view(T, Hk, K),
                v=conv[:, 2 * Hk * K:].view(T, Hv, V), a=ba[:, Hv:], b=ba[:, :Hv],
                A_log=A.log().to(conv.device), dt_bias=rnd(Hv, scale=0.5, dt=torch.float32))


def decode_inputs(batch: int, Hk: int, Hv: int, K: int, V: int, device: str | torch.device = "cuda",
                  dtype: torch.dtype = torch.bfloat16) -> dict:
    """Keyword arguments of gated_delta_update for `batch` sequences, each updating its state in
    place on its own page of a pool of batch + 1 pages (page 0: the null page)."""
    rnd = _rnd(torch.Generator(device="cpu").manual_seed(0), device, dtype)
    pages = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
    return dict(**_operands(batch, Hk, Hv, K, V, rnd),
                state=rnd(batch + 1, Hv, K, V, scale=0.1, dt=torch.float32), init_page=pages, write_page=pages)


def prefill_inputs(batch: int, seq_len: int, Hk: int, Hv: int, K: int, V: int, device: str | torch.device = "cuda",
                   dtype: torch.dtype = torch.bfloat16) -> dict:
    """Keyword arguments of gated_delta_varlen for `batch` sequences of `seq_len` new tokens,
    zero initial states, chunks of GDN_MAX_CHUNK tokens, the final state of sequence s written to
    page s + 1."""
    from kernels.gated_delta import GDN_MAX_CHUNK
    rnd = _rnd(torch.Generator(device="cpu").manual_seed(0), device, dtype)
    T = batch * seq_len
    qsl = torch.arange(0, T + 1, seq_len, dtype=torch.int32)
    starts = torch.cat([torch.arange(s, s + seq_len, GDN_MAX_CHUNK) for s in range(0, T, seq_len)])
    chunk_seq = (starts // seq_len).to(torch.int32)
    last = torch.cat([chunk_seq[1:] != chunk_seq[:-1], torch.tensor([True])])
    return dict(**_operands(T, Hk, Hv, K, V, rnd), state=torch.zeros(batch + 1, Hv, K, V, device=device),
                query_start_loc=qsl.to(device), init_page=torch.zeros(batch, dtype=torch.int32, device=device),
                chunk_start=torch.cat([starts, torch.tensor([T])]).to(torch.int32).to(device),
                chunk_seq=chunk_seq.to(device), chunk_page=torch.where(last, chunk_seq + 1, 0).to(torch.int32).to(device))


def prefill_flops(T: int, Hv: int, K: int, V: int, L: int = 64) -> float:
    """The chunk form's useful floating-point operations for T tokens (see the module docstring)."""
    per_token = 2 * L * K * 2 + 2 * K * V * 3 + 2 * L * V + L * V
    return float(T * Hv * per_token)


def hf_chunk(inp: dict, batch: int, seq_len: int) -> torch.Tensor:
    """transformers' torch chunked rule on the same (equal-length, zero-state) batch: [T, Hv, V]."""
    import inspect

    import torch.nn.functional as F
    from transformers.models.qwen3_next import modeling_qwen3_next as hf
    # the torch function itself (transformers substitutes FLA's kernel where it is installed)
    torch_chunk_gated_delta_rule = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
    T, Hk, K = inp["q"].shape
    Hv, V = inp["v"].shape[1:]
    g = -inp["A_log"].float().exp() * F.softplus(inp["a"].float() + inp["dt_bias"])
    # each key head repeated for its value heads, as Qwen3NextGatedDeltaNet.forward does before the call
    q, k = (inp[x].repeat_interleave(Hv // Hk, dim=1).reshape(batch, seq_len, Hv, K) for x in ("q", "k"))
    o, _ = torch_chunk_gated_delta_rule(q, k,
                                        inp["v"].reshape(batch, seq_len, Hv, V), g=g.reshape(batch, seq_len, Hv),
                                        beta=inp["b"].sigmoid().reshape(batch, seq_len, Hv), chunk_size=64,
                                        use_qk_l2norm_in_kernel=True)
    return o.reshape(T, Hv, V)


# (the fused kernel's BLOCK_V 16 and 32 at K = 128 with bf16 operands are refused by
# gated_delta_varlen: see its default_config; the split form's walk takes them)
PREFILL_SWEEP = ([{"BLOCK_V": 64, "num_warps": nw, "num_stages": ns, "split": False} for nw in (4, 8) for ns in (1, 2)]
                 + [{"BLOCK_V": bv, "num_warps": nw, "num_stages": 2, "split": True} for bv in (16, 32, 64)
                    for nw in (2, 4, 8)])
DECODE_SWEEP = [{"BLOCK_V": bv, "num_warps": nw} for bv in (8, 16, 32, 64) for nw in (1, 2, 4)]
PREFILL_CASES = ((1, 8192), (8, 1024))
COLUMNS = ["op", "shape", "us", "graph_us", "torch_us", "gbps", "vs_copy", "tflops", "vs_mma", "rel_err"]


def bench_gated_delta(device: str | torch.device = "cuda", sweep: bool = False, parts=("decode", "prefill"),
                      prefill_configs: list | None = None):
    """Yields rows {op, shape, us, graph_us, torch_us, gbps, vs_copy, tflops, vs_mma, rel_err} as
    they are measured. `prefill_configs` replaces the prefill kernel's launch configurations
    timed (None: its default one, and PREFILL_SWEEP with `sweep`)."""
    from triton.testing import do_bench

    from kernels.bench.graph_timing import graph_time_us
    from kernels.bench.roofline import copy_bandwidth, matmul_rate
    from kernels.gated_delta import gated_delta_update, gated_delta_varlen
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("bench_gated_delta times GPU kernels; needs a CUDA device")
    s = QWEN3_NEXT
    copy_bps = copy_bandwidth(str(device))
    mma = matmul_rate(str(device))
    yield {"op": "roofline", "shape": "copy / bf16 mma", "gbps": copy_bps / 1e9, "tflops": mma / 1e12}

    for batch in (1, 32, 128) if "decode" in parts else ():
        inp = decode_inputs(batch, **s, device=device)
        out = torch.empty_like(inp["v"])
        nbytes = 2 * batch * s["Hv"] * s["K"] * s["V"] * 4
        # copies of the state pool: a call must not find the previous call's states in L2
        copies = [inp] + [dict(inp, state=inp["state"].clone()) for _ in range(max(0, min(23, (192 << 20) // nbytes)))]
        for cfg in [None] + (DECODE_SWEEP if sweep else []):
            ms = do_bench(lambda i=inp, c=cfg, o=out: gated_delta_update(**i, out=o, config=c), return_mode="median")
            g_us = graph_time_us([lambda i=i, c=cfg, o=out: gated_delta_update(**i, out=o, config=c) for i in copies])
            name = "gated_delta_update" if cfg is None else "  update " + " ".join(f"{k}={v}" for k, v in cfg.items())
            gbps = nbytes / (g_us * 1e-6) / 1e9
            yield {"op": name, "shape": f"batch {batch}", "us": ms * 1e3, "graph_us": g_us, "gbps": gbps,
                   "vs_copy": gbps * 1e9 / copy_bps}

    configs = prefill_configs if prefill_configs is not None else [None] + (PREFILL_SWEEP if sweep else [])
    for batch, seq_len in PREFILL_CASES if "prefill" in parts else ():
        inp = prefill_inputs(batch, seq_len, **s, device=device)
        out = torch.empty_like(inp["v"])
        flops = prefill_flops(batch * seq_len, s["Hv"], s["K"], s["V"])
        ref = hf_chunk(inp, batch, seq_len).float()
        t_ref = do_bench(lambda i=inp, b=batch, n=seq_len: hf_chunk(i, b, n), return_mode="median")
        for cfg in configs:
            out.fill_(float("nan"))
            ms = do_bench(lambda i=inp, c=cfg, o=out: gated_delta_varlen(**i, out=o, config=c), return_mode="median")
            err = ((out.float() - ref).norm() / ref.norm()).item()
            name = "gated_delta_varlen" if cfg is None else "  varlen " + " ".join(f"{k}={v}" for k, v in cfg.items())
            yield {"op": name, "shape": f"{batch} x {seq_len}", "us": ms * 1e3, "torch_us": t_ref * 1e3,
                   "tflops": flops / (ms * 1e-3) / 1e12, "vs_mma": flops / (ms * 1e-3) / mma, "rel_err": err}


def _fmt_row(r: dict) -> str:
    return " | ".join(f"{r[c]:>12.4g}" if isinstance(r.get(c), float) else f"{r.get(c, '')!s:>12}" for c in COLUMNS)


def _prefill_isolated(configs: list[str]) -> None:
    """Each prefill launch configuration ("default" or "BLOCK_V,num_warps,num_stages,split") timed in
    a process of its own: one that faults (an illegal address ends the CUDA context) is
    reported, and the others are still timed."""
    import subprocess
    for arg in configs:
        r = subprocess.run([sys.executable, "-m", "kernels.bench.gated_delta", "--config", arg],
                           capture_output=True, text=True)
        rows = [line for line in r.stdout.splitlines() if "varlen" in line]
        if r.returncode:
            tail = (r.stderr.strip().splitlines() or ["?"])[-1]
            rows.append(f"  varlen {arg}: exit {r.returncode}: {tail[:160]}")
        print("\n".join(rows), flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("kernels.bench.gated_delta times Triton kernels on a GPU; no CUDA device here.", file=sys.stderr)
        return 1
    args = sys.argv[1:]
    if "--config" in args:  # one prefill launch configuration, in this process
        arg = args[args.index("--config") + 1]
        cfg = None if arg == "default" else dict(zip(("BLOCK_V", "num_warps", "num_stages", "split"),
                                                      (int(x) for x in arg.split(","))))
        for row in bench_gated_delta("cuda", parts=("prefill",), prefill_configs=[cfg]):
            print(_fmt_row(row), flush=True)
        return 0
    print(f"{torch.cuda.get_device_name()}  (Qwen3-Next Gated DeltaNet at TP 1: Hk=16 Hv=32 K=V=128, bf16, fp32 states)")
    print(" | ".join(f"{c:>12}" for c in COLUMNS), flush=True)
    sweep = "--sweep" in args
    for row in bench_gated_delta("cuda", sweep=sweep, parts=("decode",)):
        print(_fmt_row(row), flush=True)
    _prefill_isolated(["default"] + [f"{c['BLOCK_V']},{c['num_warps']},{c['num_stages']},{int(c['split'])}"
                                     for c in (PREFILL_SWEEP if sweep else [])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
