"""On one GPU: the one-shot all-reduce kernel's own cost (kernels/allreduce.py) with a world of one
(its barriers with itself, the sum, the fused norms), each in a CUDA graph of 64 back-to-back
calls, against the two norm kernels it replaces. Across GPUs the figures are
`launch/bench/allreduce.py`'s (torch symmetric memory refuses two ranks on one device).

    python -m kernels.bench.allreduce_one_rank
"""
from __future__ import annotations

import torch

from kernels.allreduce import PeerBuffers, all_reduce_rows, pad_slots
from kernels.bench.graph_timing import graph_time_us
from kernels.layernorm import rms_norm


def graph_us(fn, reps: int = 64) -> float:
    return graph_time_us([fn] * reps)


def one_rank(hidden: int = 3840) -> None:
    dev = torch.device("cuda")
    buf = torch.randn(256 * hidden, device=dev).to(torch.bfloat16)
    pad = torch.zeros(pad_slots(128, 1), dtype=torch.int32, device=dev)
    peers = PeerBuffers(torch.tensor([buf.data_ptr()], device=dev), torch.tensor([pad.data_ptr()], device=dev), 0, 1,
                        128)
    w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
    print(f"one rank, hidden {hidden}, bf16: us per call in a CUDA graph")
    for b in (1, 32, 128):
        res = torch.randn(b, hidden, device=dev).to(torch.bfloat16)
        x = buf[: b * hidden].view(b, hidden)
        plain = graph_us(lambda: all_reduce_rows(peers, b, hidden, x.dtype, dev))
        fused = graph_us(lambda: all_reduce_rows(peers, b, hidden, x.dtype, dev, residual=res, norm1=w, norm2=w,
                                                 gemma=True))
        norms = graph_us(lambda: rms_norm(rms_norm(x, w, 1e-6, gemma=True), w, 1e-6, res, gemma=True))
        print(f"B={b:4d}  sum {plain:6.2f}  sum+norm+add+norm {fused:6.2f}  two norm kernels {norms:6.2f}")
    assert int(pad[-128]) > 0, "the call counter did not move"


if __name__ == "__main__":
    one_rank()
