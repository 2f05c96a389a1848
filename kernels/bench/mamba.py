"""Timing of the Mamba-2 kernels at Bamba-9B's mixer shapes (H=128 heads, P=64, N=128, G=1,
conv width 4 over 8192 + 2*128 channels; bf16 activations), on one GPU:

(a) selective_state_update (decode) for batch 1/32/128 with bf16 and fp32 states: time, and the
    bandwidth achieved over the state bytes (each state read once and written once), against the
    device-to-device copy bandwidth measured in the same run (a large torch copy);
(b) ssd_scan_varlen against transformers' torch `mamba2_chunk_scan` (chunk_size 256), 1 x 4096
    and 8 x 512 tokens;
(c) causal_conv1d_varlen against torch F.conv1d (depthwise, zero initial state) on the same batches.

    python -m kernels.bench.mamba [--sweep]   (--sweep: also every SSD launch configuration)

`triton.testing.do_bench` (warm-up first, cold L2 per call, median). The input builders work on
any device (tests build tiny inputs on CPU).
"""
from __future__ import annotations

import math
import sys

import torch

__all__ = ["bench_mamba", "decode_inputs", "hf_chunk_scan", "prefill_inputs"]

BAMBA_9B = dict(H=128, P=64, N=128, G=1)
CONV_K = 4


def decode_inputs(batch: int, H: int, P: int, N: int, G: int, state_dtype: torch.dtype,
                  device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Keyword arguments of selective_state_update for `batch` sequences, each updating its state
    in place on its own page of a pool of batch + 1 pages (page 0: the null page)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    # B and C as views of one [S, 2*G*N] projection slice, as the mixer hands them over
    bc = rnd(batch, 2 * G * N)
    pages = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
    return dict(x=rnd(batch, H, P), dt=rnd(batch, H, scale=0.5), A=-torch.rand(H, generator=g).to(device) - 0.05,
                B=bc[:, :G * N].view(batch, G, N), C=bc[:, G * N:].view(batch, G, N),
                D=rnd(H, dt=torch.float32), dt_bias=rnd(H, scale=0.5, dt=torch.float32), dt_softplus=True,
                dt_limit=(0.0, math.inf), ssm_state=rnd(batch + 1, H, P, N, scale=0.1, dt=state_dtype),
                init_page=pages, write_page=pages)


def prefill_inputs(batch: int, seq_len: int, H: int, P: int, N: int, G: int, device: str | torch.device = "cuda",
                   dtype: torch.dtype = torch.bfloat16, conv_channels: int | None = None, K: int = CONV_K) -> dict:
    """{"ssd": kwargs of ssd_scan_varlen, "conv": kwargs of causal_conv1d_varlen} for `batch`
    sequences of `seq_len` new tokens, zero initial states, chunks of SSD_MAX_CHUNK tokens with the
    final state of every sequence written to its page (fp32 states)."""
    from kernels.mamba_ssd import SSD_MAX_CHUNK
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    T = batch * seq_len
    qsl = torch.arange(0, T + 1, seq_len, dtype=torch.int32)
    starts = torch.cat([torch.arange(s, s + seq_len, SSD_MAX_CHUNK) for s in range(0, T, seq_len)])
    chunk_start = torch.cat([starts, torch.tensor([T])]).to(torch.int32)
    chunk_seq = (starts // seq_len).to(torch.int32)
    last = torch.cat([chunk_seq[1:] != chunk_seq[:-1], torch.tensor([True])])
    chunk_page = torch.where(last, chunk_seq + 1, 0).to(torch.int32)
    init_page = torch.zeros(batch, dtype=torch.int32)
    meta = dict(query_start_loc=qsl.to(device), init_page=init_page.to(device), chunk_start=chunk_start.to(device),
                chunk_seq=chunk_seq.to(device), chunk_page=chunk_page.to(device))
    # x, B, C, dt: views of one projection output, as the mixer splits it
    proj = rnd(T, H * P + 2 * G * N + H)
    x = proj[:, :H * P].view(T, H, P)
    B = proj[:, H * P:H * P + G * N].view(T, G, N)
    C = proj[:, H * P + G * N:H * P + 2 * G * N].view(T, G, N)
    dt = proj[:, H * P + 2 * G * N:]
    ssd = dict(x=x, dt=dt, A=-torch.rand(H, generator=g).to(device) - 0.05, B=B, C=C, D=rnd(H, dt=torch.float32),
               dt_bias=rnd(H, scale=0.5, dt=torch.float32), dt_softplus=True, dt_limit=(0.0, math.inf),
               ssm_state=torch.zeros(batch + 1, H, P, N, device=device, dtype=torch.float32), **meta)
    Dc = conv_channels if conv_channels is not None else H * P + 2 * G * N
    xin = rnd(T, Dc + H * P)[:, H * P:]  # the conv input is a column slice of the projection
    conv = dict(x=xin, weight=rnd(Dc, K, scale=0.5), bias=rnd(Dc), conv_state=torch.zeros(
        batch + 1, K - 1, Dc, device=device, dtype=dtype), activation="silu", **meta)
    return {"ssd": ssd, "conv": conv, "batch": batch, "seq_len": seq_len}


def hf_chunk_scan(ssd: dict, chunk_size: int = 256) -> torch.Tensor:
    """transformers' torch scan on the same (equal-length) batch: [T, H, P]."""
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan
    T, H, P = ssd["x"].shape
    S = ssd["init_page"].shape[0]
    L = T // S
    G, N = ssd["B"].shape[1:]
    y = mamba2_chunk_scan(ssd["x"].reshape(S, L, H, P), ssd["dt"].reshape(S, L, H), ssd["A"],
                          ssd["B"].reshape(S, L, G, N), ssd["C"].reshape(S, L, G, N), chunk_size=chunk_size,
                          D=ssd["D"], dt_bias=ssd["dt_bias"], dt_softplus=True, dt_limit=ssd["dt_limit"])
    return y.reshape(T, H, P)


def _torch_conv(conv: dict, batch: int, seq_len: int) -> torch.Tensor:
    x = conv["x"].reshape(batch, seq_len, -1).transpose(1, 2)
    D, K = conv["weight"].shape
    y = torch.nn.functional.conv1d(x, conv["weight"][:, None], conv["bias"], padding=K - 1, groups=D)[..., :seq_len]
    return torch.nn.functional.silu(y)


SSD_SWEEP = [{"BLOCK_P": bp, "num_warps": nw, "num_stages": ns} for bp in (16, 32, 64) for nw in (4, 8) for ns in (1, 2)]


def _copy_ms(device: torch.device, nbytes: int) -> float:
    from triton.testing import do_bench
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return do_bench(lambda: dst.copy_(src), return_mode="median")


def bench_mamba(device: str | torch.device = "cuda", sweep: bool = False) -> list[dict]:
    """Rows {op, shape, ours_us, torch_us, speedup, gbps, vs_copy, rel_err}; with `sweep`, one
    ssd_scan_varlen row per launch configuration of SSD_SWEEP as well."""
    from triton.testing import do_bench

    from kernels.mamba_conv import causal_conv1d_varlen
    from kernels.mamba_ssd import ssd_scan_varlen
    from kernels.mamba_state_update import selective_state_update
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("bench_mamba times GPU kernels; needs a CUDA device")
    rows: list[dict] = []

    copy_ms = _copy_ms(device, 1 << 30)  # 1 GiB
    copy_gbps = 2 * (1 << 30) / (copy_ms * 1e-3) / 1e9
    rows.append({"op": "torch copy (d2d)", "shape": "1 GiB", "ours_us": copy_ms * 1e3, "gbps": copy_gbps})

    s = BAMBA_9B
    for state_dtype in (torch.bfloat16, torch.float32):
        for batch in (1, 32, 128):
            inp = decode_inputs(batch, **s, state_dtype=state_dtype, device=device)
            out = torch.empty_like(inp["x"])
            ms = do_bench(lambda inp=inp, out=out: selective_state_update(**inp, out=out), return_mode="median")
            nbytes = 2 * batch * s["H"] * s["P"] * s["N"] * inp["ssm_state"].element_size()
            gbps = nbytes / (ms * 1e-3) / 1e9
            rows.append({"op": f"state_update ({str(state_dtype)[6:]} state)", "shape": f"batch {batch}",
                         "ours_us": ms * 1e3, "gbps": gbps, "vs_copy": gbps / copy_gbps})

    for batch, seq_len in ((1, 4096), (8, 512)):
        inp = prefill_inputs(batch, seq_len, **s, device=device)
        ssd, conv = inp["ssd"], inp["conv"]
        out = torch.empty_like(ssd["x"])
        ours = do_bench(lambda ssd=ssd, out=out: ssd_scan_varlen(**ssd, out=out), return_mode="median")
        ref = do_bench(lambda ssd=ssd: hf_chunk_scan(ssd, 256), return_mode="median")
        hf = hf_chunk_scan(ssd, 256).float()
        err = ((out.float() - hf).norm() / hf.norm()).item()
        rows.append({"op": "ssd_scan_varlen", "shape": f"{batch} x {seq_len}", "ours_us": ours * 1e3,
                     "torch_us": ref * 1e3, "speedup": ref / ours, "rel_err": err})
        for cfg in SSD_SWEEP if sweep else ():
            ms = do_bench(lambda c=cfg, ssd=ssd, out=out: ssd_scan_varlen(**ssd, out=out, config=c),
                          return_mode="median")
            rows.append({"op": "  ssd " + " ".join(f"{k}={v}" for k, v in cfg.items()), "shape": f"{batch} x {seq_len}",
                         "ours_us": ms * 1e3, "speedup": ref / ms})
        cout = torch.empty(conv["x"].shape, dtype=conv["x"].dtype, device=device)
        ours = do_bench(lambda conv=conv, cout=cout: causal_conv1d_varlen(**conv, out=cout), return_mode="median")
        ref = do_bench(lambda conv=conv, b=batch, n=seq_len: _torch_conv(conv, b, n), return_mode="median")
        t = _torch_conv(conv, batch, seq_len).transpose(1, 2).reshape(cout.shape).float()
        err = ((cout.float() - t).norm() / t.norm()).item()
        nbytes = 2 * cout.numel() * cout.element_size()
        rows.append({"op": "causal_conv1d_varlen", "shape": f"{batch} x {seq_len} x {cout.shape[1]}",
                     "ours_us": ours * 1e3, "torch_us": ref * 1e3, "speedup": ref / ours,
                     "gbps": nbytes / (ours * 1e-3) / 1e9, "rel_err": err})
    return rows


def _fmt(rows: list[dict]) -> str:
    cols = ["op", "shape", "ours_us", "torch_us", "speedup", "gbps", "vs_copy", "rel_err"]
    lines = [" | ".join(f"{c:>14}" for c in cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:>14.4g}" if isinstance(v, float) else f"{v!s:>14}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main() -> int:
    if not torch.cuda.is_available():
        print("kernels.bench.mamba times Triton kernels on a GPU; no CUDA device here.", file=sys.stderr)
        return 1
    print(f"{torch.cuda.get_device_name()}  (Bamba-9B mixer: H=128 P=64 N=128 G=1, bf16 activations)")
    print(_fmt(bench_mamba("cuda", sweep="--sweep" in sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
