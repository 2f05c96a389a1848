"""The hot ops of a decoder layer: Triton kernels on a GPU, their torch references on CPU."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from kernels.activation import (fusable, relu2, relu2_ref, gelu_tanh_and_mul, gelu_tanh_and_mul_ref, sigmoid_gate_mul,
                                sigmoid_gate_mul_ref, silu_and_mul, silu_and_mul_ref, swiglu_oai_and_mul,
                                swiglu_oai_and_mul_ref)
from kernels.kv_store import store_kv, store_kv_ref
from kernels.gated_rmsnorm import GatedRMSNorm
from kernels.fp8 import dequantize_fp8, dequantize_fp8_ref
from kernels.fused_moe import fused_experts, fused_experts_ref
from kernels.fused_moe_mxfp4 import fused_experts_mxfp4, fused_experts_mxfp4_ref
from kernels.gated_delta import gated_delta_update, gated_delta_update_ref, gated_delta_varlen, gated_delta_varlen_ref
from kernels.greedy_pick import greedy_pick, greedy_pick_ref
from kernels.gemv import FP8_SKINNY_MAX_ROWS, SKINNY_MAX_ROWS, fuses_gated_norm, gemv, skinny_gemm
from kernels.layernorm import rms_norm, rms_norm_ref
from kernels.mamba_conv import (ConvStep, causal_conv1d_update, causal_conv1d_update_ref, causal_conv1d_varlen,
                                causal_conv1d_varlen_ref)
from kernels.mamba_ssd import ssd_scan_varlen, ssd_scan_varlen_ref
from kernels.mamba1_scan import (selective_scan_update, selective_scan_update_ref, selective_scan_varlen,
                                 selective_scan_varlen_ref)
from kernels.mamba_state_update import selective_state_update, selective_state_update_ref
from kernels.moe_routing import (topk_sigmoid, topk_sigmoid_grouped, topk_sigmoid_grouped_ref, topk_sigmoid_ref,
                                 topk_softmax, topk_softmax_ref)
from kernels.paged_attention import paged_attention
from kernels.paged_attention_ref import paged_attention_ref
from kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref
from kernels.rotary import rotary_embedding, rotary_embedding_ref


class _pick:  # noqa: N801 - used as a function
    """A kernel on a GPU, its torch reference on CPU. `gpu` stays visible: the experts' kernel
    applies an activation it recognises in its own epilogue."""

    def __init__(self, gpu, cpu) -> None:
        self.gpu, self.cpu = gpu, cpu

    def __call__(self, x, *a, **k):
        return (self.gpu if x.is_cuda else self.cpu)(x, *a, **k)


rms_norm_op = _pick(rms_norm, rms_norm_ref)
rotary_op = _pick(rotary_embedding, rotary_embedding_ref)
store_kv_op = _pick(store_kv, store_kv_ref)
paged_attention_op = _pick(paged_attention, paged_attention_ref)
qk_norm_rope_op = _pick(qk_norm_rope, qk_norm_rope_ref)
causal_conv1d_varlen_op = _pick(causal_conv1d_varlen, causal_conv1d_varlen_ref)
causal_conv1d_update_op = _pick(causal_conv1d_update, causal_conv1d_update_ref)
ssd_scan_varlen_op = _pick(ssd_scan_varlen, ssd_scan_varlen_ref)
selective_state_update_op = _pick(selective_state_update, selective_state_update_ref)
selective_scan_varlen_op = _pick(selective_scan_varlen, selective_scan_varlen_ref)  # Mamba-1
selective_scan_update_op = _pick(selective_scan_update, selective_scan_update_ref)
gated_delta_varlen_op = _pick(gated_delta_varlen, gated_delta_varlen_ref)
gated_delta_update_op = _pick(gated_delta_update, gated_delta_update_ref)
greedy_pick_op = _pick(greedy_pick, greedy_pick_ref)
sigmoid_gate_mul_op = _pick(sigmoid_gate_mul, sigmoid_gate_mul_ref)


def fused_experts_op(x: torch.Tensor, w13, w2, topk_weights, topk_ids, act_and_mul, *a, **k) -> torch.Tensor:
    if not x.is_cuda:
        return fused_experts_ref(x, w13, w2, topk_weights, topk_ids, act_and_mul, *a, **k)
    return fused_experts(x, w13, w2, topk_weights, topk_ids, getattr(act_and_mul, "gpu", act_and_mul), *a, **k)


fused_experts_mxfp4_op = _pick(fused_experts_mxfp4, fused_experts_mxfp4_ref)
topk_softmax_op = _pick(topk_softmax, topk_softmax_ref)
topk_sigmoid_op = _pick(topk_sigmoid, topk_sigmoid_ref)
topk_sigmoid_grouped_op = _pick(topk_sigmoid_grouped, topk_sigmoid_grouped_ref)
swiglu_oai_op = _pick(swiglu_oai_and_mul, swiglu_oai_and_mul_ref)
ACTIVATIONS = {
    "silu": _pick(silu_and_mul, silu_and_mul_ref),
    "gelu_pytorch_tanh": _pick(gelu_tanh_and_mul, gelu_tanh_and_mul_ref),
    "gelu_tanh": _pick(gelu_tanh_and_mul, gelu_tanh_and_mul_ref),
}
# Activations of MLPs without a gate (Nemotron-H's experts): [R, I] -> [R, I].
UNGATED_ACTIVATIONS = {"relu2": _pick(relu2, relu2_ref)}


def gated_norm_op(x: torch.Tensor, norm: GatedRMSNorm) -> torch.Tensor:
    """x through `norm` in a launch of its own (the torch reference on CPU)."""
    return norm.apply(x, ref=not x.is_cuda)


def _one_row(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dim() == 2 and x.shape[0] == 1


def _norm_first(x: torch.Tensor, norm: GatedRMSNorm | None, n: int) -> tuple[torch.Tensor, GatedRMSNorm | None]:
    """(x, norm) for the product: the norm stays for the one-row GEMV to apply in registers where
    it can (`fuses_gated_norm`), else runs first in its own launch."""
    if norm is None or (_one_row(x) and fuses_gated_norm(norm, n)):
        return x, norm
    return gated_norm_op(x, norm), None


def _gate_first(x: torch.Tensor, gate: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x, gate) for the product: the gate stays for the one-row GEMV, else applies first."""
    if gate is None or (_one_row(x) and gate.stride(-1) == 1):
        return x, gate
    return sigmoid_gate_mul_op(x, gate), None


def _act_first(x: torch.Tensor, act) -> tuple[torch.Tensor, tuple[int, bool] | None]:
    """(x, the activation's (ACT, GATED)) for the one-row GEMV to apply, else (act(x), None).
    One H200, Gemma-3-12B's batch-1 decode step, the activation inside down_proj's GEMV against
    its own launch (one call): FP8 weights 4.54 against 4.63 ms, bf16 7.19 against 6.73 (its
    K of 15,360 takes the whole-tile accumulator, `kernels.gemv.gemv_config`); so only the FP8
    GEMV takes it."""
    if act is None:
        return x, None
    code = fusable(getattr(act, "gpu", act))
    if code is not None and _one_row(x):
        return x, code
    return act(x), None


def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None, norm: GatedRMSNorm | None = None,
              conv: ConvStep | None = None, gate: torch.Tensor | None = None, act=None) -> torch.Tensor:
    """x W^T (+ b), into `out` when given (a 2-D x and a contiguous [rows, N] `out`): on a GPU
    one row (a batch-1 decode step) through the Triton GEMV and 2 to 32 rows through the skinny
    GEMM, faster there than cuBLAS (kernels/gemv.py); anything else through cuBLAS. A 16-bit x
    with an fp32 weight (a router kept in fp32) gives fp32, the product of x.float(): at one row
    the GEMV widens x itself (no cast launch). With `norm`, the product of norm.apply(x): the
    one-row GEMV applies it in registers, saving a launch a layer at batch 1. With `conv` (a
    decode step), the conv's columns of the product leave through it, in place (its state
    updated): in the one-row GEMV's epilogue, else in the conv's own launch after the product.
    With `gate` (x's shape), the product of x * sigmoid(gate) (an attention's output gate; in the
    one-row GEMV's prologue). With `act` (`act_and_mul`'s, or `ungated_act`'s), the product of
    act(x), the activation in its own launch first: inside a 16-bit weight's GEMV it was slower
    (`fp8_linear_op` takes it in)."""
    x, norm = _norm_first(x, norm, weight.shape[0])
    x, gate = _gate_first(x, gate)
    if act is not None:
        x = act(x)
    if _one_row(x):
        return gemv(x, weight, bias, out=out, norm=norm, conv=conv, gate=gate)
    y = _product(x, weight, bias, out)
    return y if conv is None else conv.apply(y, ref=not y.is_cuda)


# A decode batch's product with a large weight of long reduction (K >= 2N, a dense model's down
# projection) goes through cuBLASLt, whose choice there beats cuBLAS's split-K. H200, bf16, us:
# 5,120 x 17,408 at 64 / 128 / 256 rows 45.3 / 48.1 / 66.2 against 52.5 / 56.3 / 66.5; 3,840 x
# 15,360 at 128 / 256 rows 37.6 / 46.1 against 39.7 / 48.0; from 512 rows the same. Not taken:
# 2,048 x 6,144 (14.0 against 13.8), 3,840 x 4,096 (14.8 against 13.8), the LM head (688.9
# against 663.6), all at 128 rows.
LT_MAX_ROWS = 256
LT_MIN_ELEMENTS = 1 << 25


def _long_reduction(x: torch.Tensor, weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= LT_MAX_ROWS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and k >= 2 * n and n * k >= LT_MIN_ELEMENTS)


@contextmanager
def _blas(library: str):
    """torch's preferred BLAS library for the products inside (a global setting, restored)."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             out: torch.Tensor | None) -> torch.Tensor:
    if weight.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16):
        # A router kept in fp32 (Nemotron-H's): cuBLAS's fp32 product. The skinny GEMM's
        # full-precision fp32 dot (no tensor cores) over Nemotron-3-Nano's 128 x 2,688 router,
        # 4 programs, took 109 us a layer at 2 rows (one H200), 2.5 of a 5.5 ms decode step.
        return _cublas(x.float(), weight, bias, out)
    if x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= SKINNY_MAX_ROWS:
        return skinny_gemm(x, weight, bias, out=out)
    if _long_reduction(x, weight):
        with _blas("cublaslt"):
            return _cublas(x, weight, bias, out)
    return _cublas(x, weight, bias, out)


def _cublas(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.nn.functional.linear(x, weight, bias)
    if bias is None:
        return torch.mm(x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


def fp8_linear_op(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                  bias: torch.Tensor | None = None, out: torch.Tensor | None = None,
                  norm: GatedRMSNorm | None = None, gate: torch.Tensor | None = None, act=None,
                  conv: ConvStep | None = None) -> torch.Tensor:
    """`linear_op` for an FP8 weight and its scales (kernels.fp8): up to 128 rows on a GPU the
    GEMV / skinny GEMM dequantize in registers, reading the weight at one byte an element; more
    rows (prefill, big decode batches) dequantize the weight to x's dtype for cuBLAS; on CPU the
    torch references. `conv` as `linear_op`'s (in the one-row GEMV's epilogue)."""
    x, norm = _norm_first(x, norm, weight.shape[0])
    x, gate = _gate_first(x, gate)
    x, code = _act_first(x, act)
    if _one_row(x):
        return gemv(x, weight, bias, out=out, weight_scale=scale, block_size=block, norm=norm, gate=gate, act=code,
                    conv=conv)
    if x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= FP8_SKINNY_MAX_ROWS:
        y = skinny_gemm(x, weight, bias, out=out, weight_scale=scale, block_size=block)
        return y if conv is None else conv.apply(y)
    w = (dequantize_fp8 if x.is_cuda else dequantize_fp8_ref)(weight, scale, block, x.dtype)
    return linear_op(x, w, bias, out=out, conv=conv)


def cudnn_attention_available(device: torch.device) -> bool:
    """torch's cuDNN attention on a Hopper or newer GPU (where it was measured; the route below
    is not taken elsewhere)."""
    return (device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(device) >= (9, 0))


def prompt_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prompt_lens: tuple[int, ...],
                        scale: float) -> torch.Tensor:
    """Causal attention of whole prompts on their own keys (no cached context), one torch SDPA
    call a prompt: q `[T, Hq, D]`, k, v `[T, Hkv, D]` (strided views; Hkv divides Hq) ->
    `[T, Hq, D]`. On a GPU cuDNN's fused kernel alone (a RuntimeError where it cannot run, never
    a silent other backend): on an H200, Qwen3.6-27B's heads (24 / 4 of 256), an 8,192-token
    prompt took 1.24 ms against 2.61 for the paged kernel (665 against 316 TFLOP/s), a 128-token
    one 12.6 against 25.4 us. A one-token prompt (which cuDNN declined, torch 2.11) is its value.
    On CPU torch's choice (tests)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    outs = []
    t = 0
    gqa = k.shape[1] != q.shape[1]
    for n in prompt_lens:
        if n == 1:  # one key: its value for each query head of its group
            outs.append(v[t:t + 1].repeat_interleave(q.shape[1] // k.shape[1], dim=1).to(q.dtype))
            t += 1
            continue
        qs, ks, vs = (x[t:t + n].unsqueeze(0).transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) if q.is_cuda else nullcontext():
            o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                                 enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))  # cuDNN writes it in q's layout: [n, Hq, D] contiguous
        t += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def act_and_mul(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def ungated_act(name: str):
    if name not in UNGATED_ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported without a gate (supported: "
                         f"{', '.join(UNGATED_ACTIVATIONS)})")
    return UNGATED_ACTIVATIONS[name]


__all__ = ["linear_op", "fp8_linear_op", "rms_norm_op", "rotary_op", "store_kv_op", "paged_attention_op",
           "prompt_attention_op", "cudnn_attention_available", "qk_norm_rope_op",
           "act_and_mul", "ungated_act", "causal_conv1d_varlen_op", "causal_conv1d_update_op", "ssd_scan_varlen_op",
           "selective_state_update_op", "selective_scan_varlen_op", "selective_scan_update_op",
           "gated_norm_op", "gated_delta_varlen_op", "gated_delta_update_op", "greedy_pick_op",
           "fused_experts_op", "topk_softmax_op", "topk_sigmoid_op", "topk_sigmoid_grouped_op", "swiglu_oai_op",
           "torch"]
