"""Programmatic dependent launch (PDL, Hopper and later) for the kernels of a decode step.

A decode step at batch 1 is ~670 short kernels back to back; between two of them the GPU drains
one grid and only then starts launching the next. With PDL a kernel is launched while its
predecessor still runs: its programs start, wait at `griddepcontrol.wait` until the predecessor
has finished and its writes are visible, and meanwhile the launch work is done. Each kernel also
lets its own successor launch early (`launch_dependents`) once all its programs are running,
except a dense decoder's residual norms (`pdl_wait`'s `LAUNCH_NEXT`).
Measured on one H200 (`kernels/bench/pdl_layer.py`, a Gemma-3-12B-shaped batch-1 layer of 4 GEMVs
and 8 one-program kernels, in a CUDA graph): 127.2 us a layer with plain launches, 118.9 with PDL;
a Gemma-3-12B decode step at batch 1 7.24 -> 6.88 ms (the README's table).

The rule every kernel here keeps: `pdl_wait` comes before its first global load or store, so
nothing is read before its producer is done and nothing is overwritten while a predecessor may
still read it. Two exceptions, both loads: the model's weights and constant tables, which no
kernel of a step writes (the GEMV fetches its first weight tile, a norm its weight, the rotary
launches their cos/sin rows while the kernel before ends); and what a kernel at least two
launches back wrote, which nothing since overwrites (a step's inputs: positions, slots, context
lengths; the experts' second GEMV reads the router's ids, the DeltaNet update its state, a
residual norm the residual stream): a
kernel lets its successor launch only after its own wait, by when the kernel before it is done
and its writes are visible. Kernels without
PDL (cuBLAS, torch's) before or after ours are ordered as usual (they let the next launch only
when done).
`DISTENGINE_PDL=0` turns it off (for comparisons); off the GPU it never applies.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

__all__ = ["pdl_wait", "pdl_args", "pdl_enabled"]


def _read_switch() -> bool:
    text = os.environ.get("DISTENGINE_PDL", "1")
    if text not in ("0", "1"):
        raise ValueError(f"DISTENGINE_PDL must be 0 or 1, got {text!r}")
    return text == "1"


ENABLED = _read_switch()


@functools.cache
def _capable(device_index: int) -> bool:
    """Compute capability 9.0 or later, a Triton that knows `launch_pdl` (3.3 and later), and not
    Triton's interpreter. Cached: it is asked at every launch."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__ and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels on `t`'s device launch with PDL: a CUDA device of compute capability 9.0
    or later, not under Triton's interpreter, and not switched off."""
    if not (ENABLED and t.is_cuda):
        return False
    return _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())


_ON, _OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}


def pdl_args(t: torch.Tensor) -> dict:
    """The launch's keyword arguments (unpack, do not modify): the kernel's `PDL` flag, and
    Triton's `launch_pdl`."""
    return _ON if pdl_enabled(t) else _OFF


@triton.jit
def pdl_wait(PDL: tl.constexpr, LAUNCH_NEXT: tl.constexpr = True):
    """At the top of a kernel: wait for the kernel before (its writes visible), then let the
    next one launch (without `LAUNCH_NEXT` it launches as this kernel's programs exit). The
    instructions are written here with a memory clobber, which Triton's own `gdc_wait` (3.6)
    lacks: without it the compiler may move a load above the wait.

    `LAUNCH_NEXT=False` is for a one-program kernel before a dense model's projections
    (`kernels.layernorm.rms_norm`'s `feeds_dense_projection`): their programs, launched early,
    each fetch a first weight tile while the one program still reads and writes its rows, and
    that traffic delayed it more than the early start gained. It is measured, not derived: on
    one H200, at batch 1 of Gemma-3-12B with FP8 weights, the residual norms without the early
    launch took the step from 4.23 to 4.19 ms, the split attention's merge (before o_proj)
    from 4.23 to 4.30."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r,~{memory}", [], dtype=tl.int32,
                                  is_pure=False, pack=1)
        if LAUNCH_NEXT:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r,~{memory}", [],
                                      dtype=tl.int32, is_pure=False, pack=1)
