"""Timing of the layer-op Triton kernels against their eager torch references (bf16), on
realistic prefill sizes. `distengine bench kernels` (launch/bench/kernels.py) runs it; nothing runs
at import.

`triton.testing.do_bench` zeroes a 256 MB buffer before every timed call, so each measurement
starts with a cold L2 (the inputs here are larger than the H200's 50 MB L2 anyway), and the
median is reported. GB/s is the minimum traffic of our kernel (each input read once, each output
written once) over its median time. Two torch columns: the `*_ref` functions (what the engine
runs on CPU: fp32 math, several eager passes) and plain bf16 torch (`F.rms_norm`, index_put,
`F.silu` on the halves...), which is what we would run if the kernel did not pay: `speedup` is
against the latter.
"""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["bench_layer_ops"]


def _row(op: str, shape: str, ours: Callable[[], object], ref: Callable[[], object], nbytes: int,
         native: Callable[[], object]) -> dict:
    from triton.testing import do_bench
    ours_ms = do_bench(ours, return_mode="median")
    ref_ms = do_bench(ref, return_mode="median")
    native_ms = do_bench(native, return_mode="median")
    return {"op": op, "shape": shape, "ours_us": ours_ms * 1e3, "ref_us": ref_ms * 1e3,
            "torch_us": native_ms * 1e3, "speedup": native_ms / ours_ms, "gbps": nbytes / (ours_ms * 1e-3) / 1e9}


def bench_layer_ops(device: str | torch.device = "cuda", num_tokens: int = 4096) -> list[dict]:
    """Rows {op, shape, ours_us, torch_us, speedup, gbps}: rms_norm (plain, fused add, gemma) at
    hidden 4096 and 5376, rotary (32 q / 8 kv heads, head_dim 128, in a fused qkv buffer),
    store_kv (8 kv heads x 128, block 16, shuffled slots), silu/gelu_tanh_and_mul (I=14336)."""
    from kernels.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_ref, silu_and_mul, silu_and_mul_ref
    from kernels.kv_store import store_kv, store_kv_ref
    from kernels.layernorm import rms_norm, rms_norm_ref
    from kernels.rotary import make_rope_cache, rotary_embedding, rotary_embedding_ref

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("bench_layer_ops times GPU kernels; needs a CUDA device")
    T, dt, es = num_tokens, torch.bfloat16, 2
    rows: list[dict] = []

    for hidden in (4096, 5376):
        x = torch.randn(T, hidden, device=device, dtype=dt)
        res = torch.randn_like(x)
        w = torch.randn(hidden, device=device, dtype=dt)
        io = T * hidden * es
        F, shape = torch.nn.functional, (hidden,)
        rows.append(_row("rms_norm", f"[{T},{hidden}]", lambda: rms_norm(x, w, 1e-6),
                         lambda: rms_norm_ref(x, w, 1e-6), 2 * io, lambda: F.rms_norm(x, shape, w, 1e-6)))
        rows.append(_row("rms_norm+add", f"[{T},{hidden}]", lambda: rms_norm(x, w, 1e-6, res),
                         lambda: rms_norm_ref(x, w, 1e-6, res), 4 * io,
                         lambda: F.rms_norm(x + res, shape, w, 1e-6)))
        rows.append(_row("rms_norm(gemma)+add", f"[{T},{hidden}]", lambda: rms_norm(x, w, 1e-6, res, gemma=True),
                         lambda: rms_norm_ref(x, w, 1e-6, res, gemma=True), 4 * io,
                         lambda: F.rms_norm(x + res, shape, 1 + w, 1e-6)))

    n_q, n_k, hd = 32, 8, 128
    qkv = torch.randn(T, (n_q + 2 * n_k) * hd, device=device, dtype=dt)
    q = qkv[:, : n_q * hd].view(T, n_q, hd)
    k = qkv[:, n_q * hd: (n_q + n_k) * hd].view(T, n_k, hd)
    cache = make_rope_cache(hd, 131072, 500000.0, None, torch.float32, device)
    pos = torch.randint(0, 131072, (T,), device=device)
    def rotary_torch():
        cos, sin = cache[pos].to(dt)[:, None, :].chunk(2, dim=-1)
        for x_ in (q, k):
            x1, x2 = x_.chunk(2, dim=-1)
            x_.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))
    rows.append(_row("rotary", f"q[{T},{n_q},{hd}] k[{T},{n_k},{hd}]",
                     lambda: rotary_embedding(q, k, pos, cache), lambda: rotary_embedding_ref(q, k, pos, cache),
                     2 * T * (n_q + n_k) * hd * es + T * hd * 4, rotary_torch))

    bs = 16
    num_blocks = 2 * T // bs + 1
    key, value = torch.randn(T, n_k, hd, device=device, dtype=dt), torch.randn(T, n_k, hd, device=device, dtype=dt)
    kv_cache = torch.zeros(num_blocks, 2, bs, n_k, hd, device=device, dtype=dt)
    slots = (torch.randperm((num_blocks - 1) * bs, device=device)[:T] + bs).to(torch.int64)
    def store_torch():
        blk, off = slots // bs, slots % bs
        kv_cache[blk, 0, off] = key
        kv_cache[blk, 1, off] = value
    rows.append(_row("store_kv", f"[{T},{n_k},{hd}] block {bs}", lambda: store_kv(key, value, kv_cache, slots),
                     lambda: store_kv_ref(key, value, kv_cache, slots), 4 * T * n_k * hd * es + 8 * T, store_torch))

    inter = 14336
    x = torch.randn(T, 2 * inter, device=device, dtype=dt)
    F = torch.nn.functional
    for name, ours, ref, native in (
            ("silu_and_mul", silu_and_mul, silu_and_mul_ref, lambda: F.silu(x[:, :inter]) * x[:, inter:]),
            ("gelu_tanh_and_mul", gelu_tanh_and_mul, gelu_tanh_and_mul_ref,
             lambda: F.gelu(x[:, :inter], approximate="tanh") * x[:, inter:])):
        rows.append(_row(name, f"[{T},{2 * inter}]", lambda f=ours: f(x), lambda f=ref: f(x), 3 * T * inter * es,
                         native))
    return rows
