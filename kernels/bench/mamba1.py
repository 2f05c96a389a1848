"""Timing of the Mamba-1 scan kernels (`kernels/mamba1_scan.py`) at Jamba-Mini's mixer shape
(8192 channels at TP=1, d_state 16, bf16 activations and states), on one GPU:

(a) selective_scan_update (decode) for batch 1/32/128: time, and the bandwidth achieved over the
    state bytes (each state read once and written once), against the device-to-device copy
    bandwidth measured in the same run;
(b) selective_scan_varlen (prefill) for 1 x 4096 and 8 x 512 tokens against transformers' torch
    `mamba_selective_scan` (Jamba's, sequential over the tokens), with the relative difference.

    python -m kernels.bench.mamba1

`triton.testing.do_bench` (warm-up first, cold L2 per call, median). The input builder works on
any device (a test builds tiny inputs on CPU).
"""
from __future__ import annotations

import sys

import torch

from kernels.bench.mamba import _copy_ms, _fmt

__all__ = ["bench_mamba1", "scan_inputs"]

JAMBA_MINI = dict(channels=8192, N=16)


def scan_inputs(batch: int, seq_len: int, channels: int, N: int, device: str | torch.device = "cuda",
                dtype: torch.dtype = torch.bfloat16) -> dict:
    """Keyword arguments of selective_scan_varlen for `batch` sequences of `seq_len` tokens, each
    starting from and writing its final state to its own page (chunks of 64 tokens); with
    seq_len 1 they serve selective_scan_update as well (`decode_args`)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dt)

    T = batch * seq_len
    qsl = torch.arange(0, T + 1, seq_len, dtype=torch.int32)
    starts, seqs = [], []
    for s in range(batch):
        for t in range(s * seq_len, (s + 1) * seq_len, 64):
            starts.append(t)
            seqs.append(s)
    pages = torch.arange(1, batch + 1, dtype=torch.int32)
    chunk_seq = torch.tensor(seqs, dtype=torch.int32)
    last = torch.tensor([i + 1 == len(seqs) or seqs[i + 1] != s for i, s in enumerate(seqs)])
    proj = rnd(T, 2 * channels)  # x | z as the mixer hands them over (views of in_proj's output)
    bc = rnd(T, 2 * N)
    A = -torch.exp(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).expand(channels, N)).contiguous()
    i32 = {"dtype": torch.int32, "device": device}
    return dict(x=proj[:, :channels], dt=rnd(T, channels, scale=0.5) - 2.0, A=A.to(device), B=bc[:, :N], C=bc[:, N:],
                D=rnd(channels, dt=torch.float32), dt_bias=rnd(channels, scale=0.5, dt=torch.float32),
                ssm_state=rnd(batch + 1, channels, N, scale=0.1), query_start_loc=qsl.to(**i32),
                init_page=pages.to(**i32), chunk_start=torch.tensor(starts + [T]).to(**i32),
                chunk_seq=chunk_seq.to(**i32), chunk_page=torch.where(last, pages[chunk_seq.long()], 0).to(**i32),
                z=proj[:, channels:])


def decode_args(inp: dict) -> dict:
    """selective_scan_update's keyword arguments from `scan_inputs(batch, 1, ...)`: in place."""
    keep = ("x", "dt", "A", "B", "C", "D", "dt_bias", "ssm_state", "z")
    return {**{k: inp[k] for k in keep}, "init_page": inp["init_page"], "write_page": inp["init_page"]}


def hf_scan(inp: dict, batch: int, seq_len: int) -> torch.Tensor:
    """transformers' Jamba torch scan on the same batch (zero initial states): [T, channels]."""
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan

    def seqs(t):  # [T, C] -> [batch, C, seq_len]
        return t.reshape(batch, seq_len, -1).transpose(1, 2)
    y = mamba_selective_scan(seqs(inp["x"]), seqs(inp["dt"]), inp["A"], seqs(inp["B"]), seqs(inp["C"]), D=inp["D"],
                             z=seqs(inp["z"]), delta_bias=inp["dt_bias"], delta_softplus=True)
    return y.transpose(1, 2).reshape(batch * seq_len, -1)


def bench_mamba1(device: str | torch.device = "cuda") -> list[dict]:
    """Rows {op, shape, ours_us, torch_us, speedup, gbps, vs_copy, rel_err}."""
    from triton.testing import do_bench

    from kernels.mamba1_scan import selective_scan_update, selective_scan_varlen
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("bench_mamba1 times GPU kernels; needs a CUDA device")
    copy_ms = _copy_ms(device, 1 << 30)
    copy_gbps = 2 * (1 << 30) / (copy_ms * 1e-3) / 1e9
    rows: list[dict] = [{"op": "torch copy (d2d)", "shape": "1 GiB", "ours_us": copy_ms * 1e3, "gbps": copy_gbps}]
    s = JAMBA_MINI
    for batch in (1, 32, 128):
        args = decode_args(scan_inputs(batch, 1, **s, device=device))
        out = torch.empty_like(args["x"])
        ms = do_bench(lambda a=args, o=out: selective_scan_update(**a, out=o), return_mode="median")
        nbytes = 2 * batch * s["channels"] * s["N"] * args["ssm_state"].element_size()
        gbps = nbytes / (ms * 1e-3) / 1e9
        rows.append({"op": "scan_update (bf16 state)", "shape": f"batch {batch}", "ours_us": ms * 1e3, "gbps": gbps,
                     "vs_copy": gbps / copy_gbps})
    for batch, seq_len in ((1, 4096), (8, 512)):
        inp = scan_inputs(batch, seq_len, **s, device=device)
        inp["ssm_state"].zero_()  # transformers' scan starts from zeros
        out = torch.empty_like(inp["dt"])
        ours = do_bench(lambda i=inp, o=out: selective_scan_varlen(**i, out=o), return_mode="median")
        ref = do_bench(lambda i=inp, b=batch, n=seq_len: hf_scan(i, b, n), rep=200, return_mode="median")
        inp["ssm_state"].zero_()
        selective_scan_varlen(**inp, out=out)
        hf = hf_scan(inp, batch, seq_len).float()
        err = ((out.float() - hf).norm() / hf.norm()).item()
        rows.append({"op": "scan_varlen", "shape": f"{batch} x {seq_len}", "ours_us": ours * 1e3,
                     "torch_us": ref * 1e3, "speedup": ref / ours, "rel_err": err})
    return rows


def main() -> int:
    if not torch.cuda.is_available():
        print("kernels.bench.mamba1 times Triton kernels on a GPU; no CUDA device here.", file=sys.stderr)
        return 1
    print(f"{torch.cuda.get_device_name()}  (Jamba-Mini mixer at TP=1: 8192 channels, d_state 16, bf16)")
    print(_fmt(bench_mamba1("cuda")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
