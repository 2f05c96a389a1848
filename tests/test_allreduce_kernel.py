"""The one-shot all-reduce kernel (kernels/allreduce.py) against its torch reference evaluated in
float64, outputs poisoned before every call, and its fused norms bit for bit against the plain sum
followed by the norm kernels (the tokens of a model must not depend on the fusion). Without a GPU
it runs under Triton's interpreter with one rank (the barriers with itself, the sums and the
fused norms). On a GPU the ranks are simulated on one device: each rank's buffer and flag array
are separate allocations, and each rank's kernel runs on its own stream, so the kernels meet in
their barriers as they do across GPUs (the two-GPU path through torch symmetric memory is
tests/test_tensor_parallel.py's and tests/test_cuda_graphs.py's, on a host with two GPUs)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from kernels.allreduce import PeerBuffers, all_reduce_rows, all_reduce_rows_ref, pad_slots
from kernels.layernorm import rms_norm

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output (unwritten or poisoned elements)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


class Ranks:
    """W simulated ranks on one device: a buffer and a zeroed signal pad each, and every rank's
    view of them (here the same addresses)."""

    def __init__(self, world: int, numel: int, dtype: torch.dtype, max_programs: int) -> None:
        self.bufs = [torch.full((numel,), float("nan"), dtype=dtype, device=DEVICE) for _ in range(world)]
        self.pads = [torch.zeros(pad_slots(max_programs, world), dtype=torch.int32, device=DEVICE)
                     for _ in range(world)]
        ptrs = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64, device=DEVICE)
        pads = torch.tensor([p.data_ptr() for p in self.pads], dtype=torch.int64, device=DEVICE)
        self.peers = [PeerBuffers(ptrs, pads, r, world, max_programs) for r in range(world)]
        self.barriers = torch.zeros(max_programs, dtype=torch.int32)  # two per call per program that ran

    def run(self, parts: list[torch.Tensor], **kw) -> list:
        """Each rank's partials into its buffer, then every rank's kernel, each on its own stream.
        Everything is allocated first: an allocation between two launches could queue work
        behind a kernel that waits for the next rank's."""
        n, h = parts[0].shape
        for buf, p in zip(self.bufs, parts):
            buf[: n * h].copy_(p.reshape(-1))
        outs = [torch.full((n, h), float("nan"), dtype=parts[0].dtype, device=DEVICE) for _ in parts]
        new_res = [torch.full((n, h), float("nan"), dtype=parts[0].dtype, device=DEVICE)
                   if kw.get("residual") is not None else None for _ in parts]
        streams = [torch.cuda.Stream() for _ in parts] if GPU else [None] * len(parts)
        if GPU:
            torch.cuda.synchronize()
        got = []
        for peers, s, out, nr in zip(self.peers, streams, outs, new_res):
            with torch.cuda.stream(s) if GPU else contextlib.nullcontext():
                got.append(all_reduce_rows(peers, n, h, out.dtype, out.device, out=out, new_residual=nr, **kw))
        if GPU:
            torch.cuda.synchronize()
        self.barriers[: min(n, len(self.barriers))] += 2
        for pad in self.pads:
            assert torch.equal(pad[-len(self.barriers):].cpu(), self.barriers), "call counters out of step"
        return got


WORLDS = [2, 4] if GPU else [1]
ROWS = [1, 5, 37, 130] if GPU else [1, 5]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("fused", ["plain", "add_norm", "norm_add_norm", "norm"])
@pytest.mark.parametrize("gemma", [False, True], ids=["w", "1+w"])
def test_one_shot_all_reduce(world, dtype, fused, gemma):
    hidden = 3840 if GPU else 200
    eps = 1e-6
    ranks = Ranks(world, max(ROWS) * hidden, dtype, max_programs=64)
    for n in ROWS:  # one set of flag arrays for every size and call
        parts = [torch.randn(n, hidden, device=DEVICE).to(dtype) for _ in range(world)]
        residual = torch.randn(n, hidden, device=DEVICE).to(dtype) if "add" in fused else None
        w1 = (1 + 0.2 * torch.randn(hidden, device=DEVICE)).to(dtype) if fused == "norm_add_norm" else None
        w2 = (1 + 0.2 * torch.randn(hidden, device=DEVICE)).to(dtype) if fused != "plain" else None
        kw = dict(residual=residual, norm1=w1, norm2=w2, eps=eps, gemma=gemma)
        outs = ranks.run(parts, **kw)
        dbl = lambda t: None if t is None else t.double()  # noqa: E731
        ref = all_reduce_rows_ref([p.double() for p in parts], dbl(residual), dbl(w1), dbl(w2), eps, gemma)
        for got in outs:
            if residual is None:
                assert rel_err(got, ref) < TOL[dtype]
            else:
                assert rel_err(got[0], ref[0]) < TOL[dtype] and rel_err(got[1], ref[1]) < TOL[dtype]
        if fused != "plain":  # the bits of the unfused chain: the plain sum, then the norm kernels
            total = ranks.run(parts)[0]
            if fused == "norm":
                want = rms_norm(total, w2, eps, gemma=gemma)
                assert torch.equal(outs[0], want)
            else:
                want = rms_norm(total, w2, eps, residual, gemma=gemma, pre_weight=w1)
                assert torch.equal(outs[0][0], want[0]) and torch.equal(outs[0][1], want[1])
        for got in outs[1:]:  # every rank computes the same bits
            assert all(torch.equal(a, b) for a, b in zip(got if residual is not None else [got],
                                                          outs[0] if residual is not None else [outs[0]]))


@pytest.mark.gpu  # two ranks need concurrent kernels
def test_two_rank_sum_equals_a_rounded_add():
    """Two ranks: the sum is what one rounded add of the partials gives (NCCL's bf16 result)."""
    ranks = Ranks(2, 64 * 3840, torch.bfloat16, max_programs=16)
    parts = [torch.randn(64, 3840, device=DEVICE).to(torch.bfloat16) * 10 ** i for i in range(2)]
    a, b = ranks.run(parts)
    assert torch.equal(a, parts[0] + parts[1]) and torch.equal(b, a)


def test_bad_arguments():
    ptrs = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="int64 tensor of 2"):
        PeerBuffers(ptrs.int(), ptrs, 0, 2, 4)
    with pytest.raises(ValueError, match="rank 2 outside"):
        PeerBuffers(ptrs, ptrs, 2, 2, 4)
    peers = PeerBuffers(ptrs, ptrs, 0, 2, 4)
    with pytest.raises(ValueError, match="residual must be"):
        all_reduce_rows(peers, 3, 8, torch.float32, torch.device("cpu"), residual=torch.zeros(3, 9))
    with pytest.raises(ValueError, match="norm2 must have 8"):
        all_reduce_rows(peers, 3, 8, torch.float32, torch.device("cpu"), norm2=torch.zeros(7))
