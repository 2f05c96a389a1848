"""One-shot all-reduce over peer-to-peer memory, optionally fused with what follows it in a
decoder layer: an RMSNorm of the sum, the residual add, and the next RMSNorm.

Every rank has written its partial sums into its own buffer of a symmetric allocation (torch
symmetric memory: each rank can load from every peer's buffer over NVLink). One kernel then:
waits until every rank has arrived (so every partial is complete), sums the W buffers row by row
in fp32, rounds the sum to the buffers' dtype (what NCCL returns), applies the optional
`norm1`, adds the residual and applies `norm2`, writes those outputs locally, and waits for every
rank again before it exits, so no rank overwrites its buffer while a peer still reads it.

Why: at decode sizes (a few KB to a MB) an all-reduce is latency: NCCL takes 12-19 us per call
inside a CUDA graph on two H200s (`launch/bench/allreduce.py`), most of it fixed cost, and a
decode step of a 48-layer model makes 96 of them. The one-shot kernel reads the peer's rows
once, with no intermediate copies; fused with the norms it also saves their launches and their
passes over the rows (with PDL in a CUDA graph a norm launch alone cost next to nothing on one
GPU; after NCCL's kernel, which takes no part in PDL, it cannot start early).

The barrier (one per program, matched by program id across ranks; vLLM's custom all-reduce
uses the same scheme): program p keeps a call counter in its rank's flag array; each barrier takes
the next value `flag`, stores it (release, system scope) into slot [flag & 1, p, r] of every rank's
array, r being its own rank, and waits (acquire) until its own slots [flag & 1, p, 0..W-1] all
hold `flag`. The stores are posted, not round trips, and nothing has to be reset, so one array
serves call after call and CUDA graph replays without a host-side counter. Two parities keep a
rank that is already one barrier ahead from overwriting a slot a peer still waits on. The acquire
orders the peers' partials (written before the kernel) before the loads; the end barrier orders
every peer's loads before any rank's next write into its buffer. Every rank must launch the same
grid: the row count and the program cap are the same on every rank.

Numerics: for two ranks the sum is computed in fp32 and rounded once to the buffer dtype; fp32
carries more than twice bf16's and fp16's precision plus two bits, so this equals the correctly
rounded sum that NCCL returns. The norms follow `kernels.layernorm` (the residual sum rounded,
the norm computed in fp32 from the rounded value), bit for bit (tests/test_allreduce_kernel.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.layernorm import rms_norm_ref
from kernels.pdl import pdl_args, pdl_wait

__all__ = ["PeerBuffers", "all_reduce_rows", "all_reduce_rows_ref", "pad_slots"]


@triton.jit
def _barrier(pad_ptrs, pid, flag, rank, max_programs, WORLD: tl.constexpr):
    """Wait until program `pid` of every rank has reached the barrier numbered `flag`."""
    slot = ((flag & 1) * max_programs + pid) * WORLD
    for r in tl.static_range(WORLD):
        pad = tl.load(pad_ptrs + r).to(tl.pointer_type(tl.int32))
        tl.atomic_xchg(pad + slot + rank, flag, sem="release", scope="sys")
    own = tl.load(pad_ptrs + rank).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        while tl.atomic_add(own + slot + r, 0, sem="acquire", scope="sys") != flag:
            pass
    tl.debug_barrier()


@triton.jit
def _norm(x, w_ptr, cols, mask, n_cols, eps, GEMMA: tl.constexpr):
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = w + 1.0
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    return x * rstd * w


# The row count changes with the batch: not specialised, so one compiled kernel serves them all.
@triton.jit(do_not_specialize=["n_rows", "rank"])
def _one_shot_kernel(buf_ptrs, pad_ptrs, res_ptr, w1_ptr, w2_ptr, out_ptr, new_res_ptr,
                     n_rows, n_cols, eps, rank, max_programs,
                     WORLD: tl.constexpr, HAS_NORM1: tl.constexpr, HAS_RES: tl.constexpr,
                     HAS_NORM2: tl.constexpr, GEMMA: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    pid = tl.program_id(0)
    # This program's call counter, after the two parities of signal slots.
    counter = tl.load(pad_ptrs + rank).to(tl.pointer_type(tl.int32)) + 2 * max_programs * WORLD + pid
    flag = tl.load(counter) + 1
    _barrier(pad_ptrs, pid, flag, rank, max_programs, WORLD)
    dtype = out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    for row in range(pid, n_rows, tl.num_programs(0)):
        offs = row * n_cols + cols  # < 2**31 (checked by the caller)
        acc = tl.zeros([BLOCK], tl.float32)
        for r in tl.static_range(WORLD):
            src = tl.load(buf_ptrs + r).to(tl.pointer_type(dtype))
            # .cv: a peer's rows change between calls, no cached copy may be read (and unlike a
            # volatile load it still vectorises).
            acc += tl.load(src + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
        x = acc.to(dtype).to(tl.float32)
        if HAS_NORM1:
            x = _norm(x, w1_ptr, cols, mask, n_cols, eps, GEMMA).to(dtype).to(tl.float32)
        if HAS_RES:
            x = (x + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dtype)
            tl.store(new_res_ptr + offs, x, mask=mask)
            x = x.to(tl.float32)
        if HAS_NORM2:
            x = _norm(x, w2_ptr, cols, mask, n_cols, eps, GEMMA)
        tl.store(out_ptr + offs, x.to(dtype), mask=mask)
    tl.debug_barrier()
    _barrier(pad_ptrs, pid, flag + 1, rank, max_programs, WORLD)
    tl.store(counter, flag + 1)


@dataclass(frozen=True)
class PeerBuffers:
    """Where the W ranks' buffers and flag arrays are, as this rank sees them: device int64
    tensors of W addresses (each peer's memory mapped into this process), zero-filled int32 flag
    arrays of at least `pad_slots(max_programs, W)` entries, and this rank's index."""

    buffer_ptrs: torch.Tensor
    pad_ptrs: torch.Tensor
    rank: int
    world_size: int
    max_programs: int

    def __post_init__(self) -> None:
        for name in ("buffer_ptrs", "pad_ptrs"):
            t = getattr(self, name)
            if t.dtype != torch.int64 or t.shape != (self.world_size,):
                raise ValueError(f"{name} must be an int64 tensor of {self.world_size} addresses, "
                                 f"got {t.dtype} {tuple(t.shape)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a world of {self.world_size}")
        if self.max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {self.max_programs}")


def pad_slots(max_programs: int, world_size: int) -> int:
    """int32 entries of one rank's flag array: two parities of [program, rank] slots, then one
    call counter per program."""
    return (2 * world_size + 1) * max_programs


def all_reduce_rows(peers: PeerBuffers, n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device,
                    residual: torch.Tensor | None = None, norm1: torch.Tensor | None = None,
                    norm2: torch.Tensor | None = None, eps: float = 1e-6, gemma: bool = False,
                    out: torch.Tensor | None = None, new_residual: torch.Tensor | None = None,
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The sum over ranks of the [n_rows, n_cols] rows at the start of every rank's buffer, then
    `norm1` (weights of an RMSNorm), `+ residual`, `norm2`: returns `out`, and with a residual
    also `new_residual` (the stream after the add), new tensors unless given. Every rank calls
    it with the same sizes and options."""
    if residual is not None and residual.shape != (n_rows, n_cols):
        raise ValueError(f"residual must be [{n_rows}, {n_cols}], got {tuple(residual.shape)}")
    for name, w in (("norm1", norm1), ("norm2", norm2)):
        if w is not None and w.shape != (n_cols,):
            raise ValueError(f"{name} must have {n_cols} weights, got {tuple(w.shape)}")
    out = torch.empty((n_rows, n_cols), dtype=dtype, device=device) if out is None else out
    if residual is not None and new_residual is None:
        new_residual = torch.empty_like(out)
    for name, t in (("residual", residual), ("out", out), ("new_residual", new_residual)):
        if t is not None and (t.shape != (n_rows, n_cols) or not t.is_contiguous() or t.dtype != dtype):
            raise ValueError(f"{name} must be a contiguous {dtype} [{n_rows}, {n_cols}] tensor")
    if n_rows * n_cols >= 2 ** 31:
        raise ValueError(f"{n_rows} x {n_cols} elements: too many for one call (int32 offsets)")
    if n_rows > 0:
        block = triton.next_power_of_2(n_cols)
        _one_shot_kernel[(min(n_rows, peers.max_programs),)](
            peers.buffer_ptrs, peers.pad_ptrs, residual if residual is not None else out,
            norm1 if norm1 is not None else out, norm2 if norm2 is not None else out, out,
            new_residual if new_residual is not None else out, n_rows, n_cols, float(eps), peers.rank,
            peers.max_programs,
            WORLD=peers.world_size, HAS_NORM1=norm1 is not None, HAS_RES=residual is not None,
            HAS_NORM2=norm2 is not None, GEMMA=gemma, BLOCK=block,
            num_warps=4 if block <= 2048 else 8 if block <= 8192 else 16, **pdl_args(out))
    return (out, new_residual) if residual is not None else out


def all_reduce_rows_ref(parts: list[torch.Tensor], residual: torch.Tensor | None = None,
                        norm1: torch.Tensor | None = None, norm2: torch.Tensor | None = None, eps: float = 1e-6,
                        gemma: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The same chain on the ranks' partials, in fp32 (fp64 for fp64 inputs): the sum rounded
    to the partials' dtype, then the norms of `kernels.layernorm.rms_norm_ref`."""
    acc = torch.promote_types(parts[0].dtype, torch.float32)
    x = torch.stack([p.to(acc) for p in parts]).sum(0).to(parts[0].dtype)
    if norm1 is not None:
        x = rms_norm_ref(x, norm1, eps, gemma=gemma)
    new_res = None
    if residual is not None:
        new_res = (x.to(acc) + residual.to(acc)).to(x.dtype)
        x = new_res
    if norm2 is not None:
        x = rms_norm_ref(x, norm2, eps, gemma=gemma)
    return (x, new_res) if residual is not None else x
