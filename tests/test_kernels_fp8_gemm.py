"""W8A8 (kernels.fp8_gemm): x quantized per (row, 128 columns) to e4m3 inside the kernel, the dot on
two e4m3 tiles. Against `w8a8_gemm_ref` (float64 of the quantized x times the FP8 weight), outputs
NaN-poisoned first. On CPU Triton's interpreter runs the e4m3 dot and loads, and `div_rn`; its own
fp32 -> e4m3 conversion drops rounding carries, so there the kernel rounds in fp32 first
(`_round_e4m3`, exact) and the conversion instruction itself is only checked on a GPU."""
from __future__ import annotations

import pytest
import torch

from kernels.fp8 import FP8_DTYPE, quantize_fp8_ref
from kernels.fp8_gemm import ACT_GROUP, quantize_act_ref, w8a8_gemm, w8a8_gemm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = (128, 128)
SCHEMES = {"row": None, "block": BLOCK}
# The kernel against the reference of the same quantized product: fp32 sums, one rounding to x's dtype.
TOL = {torch.bfloat16: 6e-3, torch.float16: 1e-3}


def _weight(n: int, k: int, block):
    """(FP8 weight, fp32 scales spread over two decades, so that a scale applied to the wrong block
    shows); entries ~1/sqrt(K), so that float16 outputs stay finite."""
    q, s = quantize_fp8_ref(torch.randn(n, k) / k ** 0.5, block)
    return q.to(DEVICE), (s * torch.exp(torch.randn(s.shape) * 1.5)).to(DEVICE)


def _x(m: int, k: int, dtype) -> torch.Tensor:
    """Activations whose 128-column groups differ in size by decades (one scale a row would lose
    the small groups), one row all zeros."""
    groups = -(-k // ACT_GROUP)
    size = torch.exp(torch.randn(m, groups) * 1.5).repeat_interleave(ACT_GROUP, 1)[:, :k]
    x = torch.randn(m, k) * size
    x[m // 2] = 0
    return x.to(dtype).to(DEVICE)


def _check(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape and torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], err


def _run(m, n, k, scheme, dtype, cfg=None, bias=True):
    block = SCHEMES[scheme]
    q, s = _weight(n, k, block)
    x = _x(m, k, dtype)
    b = torch.randn(n).to(dtype).to(DEVICE) if bias else None
    ref = w8a8_gemm_ref(x, q, s, block, b)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
    got = w8a8_gemm(x, q, s, block, b, out=out, config=cfg)
    assert got.data_ptr() == out.data_ptr()
    _check(got, ref, dtype)
    # The quantized product is the exact one up to half an e4m3 step (2^-4 relative) of each x
    # element (plus the subnormals' absolute step, under 2^-9 / 448 of a group's largest).
    w64 = q.double() * (s.double()[:, None] if block is None else
                        s.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k])
    x64 = x.double()
    exact = x64 @ w64.t() + (0 if b is None else b.double())
    bound = (x64.abs() @ w64.abs().t()) / 16 + x64.abs().amax(1, keepdim=True) * w64.abs().sum(1) * 1e-5
    assert ((ref - exact).abs() <= bound).all()


def test_quantize_act_ref_rule():
    """Each (row, group)'s largest magnitude lands on +-448, a zero group gets the floor's finite
    scale and zeros, the last group may be partial, and values round to nearest e4m3."""
    x = torch.randn(3, 300) * torch.tensor([[1e-3], [1.0], [1e3]])
    x[1, 128:256] = 0
    q, s = quantize_act_ref(x.to(torch.bfloat16))
    assert q.dtype == FP8_DTYPE and q.shape == (3, 300) and s.shape == (3, 3) and s.dtype == torch.float32
    assert torch.isfinite(s).all() and (s > 0).all()
    assert (q[1, 128:256].float() == 0).all()
    for r, g in ((0, 0), (2, 1), (2, 2)):  # group 2 is 44 columns
        part = q[r, g * 128:(g + 1) * 128].float()
        assert part.abs().max().item() == 448.0
    back = q.float() * s.repeat_interleave(128, 1)[:, :300]
    xb = x.to(torch.bfloat16).float()
    assert ((back - xb).abs() <= xb.abs() / 16 + 1e-30).all()  # half an e4m3 step (2^-3) at most


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m,n,k,cfg", [
    (3, 300, 200, None),  # ragged: N, K not whole tiles, a partial last group and weight block
    (5, 128, 256, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SWAP": True, "num_warps": 4, "num_stages": 2}),
    (17, 256, 384, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 256, "SWAP": False, "num_warps": 4, "num_stages": 2}),
    (70, 64, 256, None),  # two 64-row tiles
])
def test_w8a8_gemm(scheme, dtype, m, n, k, cfg):
    _run(m, n, k, scheme, dtype, cfg)


def test_w8a8_bad_arguments():
    q, s = _weight(256, 256, BLOCK)
    x = torch.randn(2, 256, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 or float16 x"):
        w8a8_gemm(x.float(), q, s, BLOCK)
    with pytest.raises(ValueError, match="1 to 128 rows"):
        w8a8_gemm(torch.zeros(129, 256, device=DEVICE, dtype=torch.bfloat16), q, s, BLOCK)
    q64, s64 = _weight(256, 256, (128, 64))
    with pytest.raises(ValueError, match="whole 128-column activation groups"):
        w8a8_gemm(x, q64, s64, (128, 64))
    with pytest.raises(ValueError, match="BLOCK_K must be a multiple of 128"):
        w8a8_gemm(x, q, s, BLOCK, config={"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SWAP": True,
                                          "num_warps": 4, "num_stages": 1})


# Gemma-3-12B's projections (N, K) and ragged ones, at the decode row counts.
GPU_SHAPES = {"qkv": (8192, 3840), "o_proj": (3840, 4096), "gate_up": (30720, 3840), "down": (3840, 15360),
              "ragged": (1000, 1500)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("rows", [1, 7, 32, 128])
def test_w8a8_gemm_on_gpu(shape, scheme, rows):
    n, k = GPU_SHAPES[shape]
    _run(rows, n, k, scheme, torch.bfloat16, bias=shape == "ragged")


@pytest.mark.gpu
@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("block_m,block_n", [(16, 64), (32, 128), (64, 64)])
def test_w8a8_gemm_tiles_on_gpu(swap, block_m, block_n):
    """The layouts the sweep tries, each against the reference (100 rows: two row tiles or more)."""
    cfg = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 256, "SWAP": swap, "num_warps": 4, "num_stages": 3}
    _run(100, 1024, 1920, "block", torch.bfloat16, cfg)


def test_fp8_linear_op_with_w8a8_routes_by_device_and_rows():
    """The layers' entry point with `w8a8`: on a GPU 1-128 rows through `w8a8_gemm`, more (prefill)
    dequantized for cuBLAS; on CPU the weight-only reference (W8A16) at any rows."""
    from kernels.fp8 import dequantize_fp8_ref
    from workers.ops import fp8_linear_op
    q, s = _weight(256, 384, BLOCK)
    b = torch.randn(256).to(torch.bfloat16).to(DEVICE)
    weight_only = dequantize_fp8_ref(q, s, BLOCK, torch.float64)
    for rows in ((1, 3, 128, 129) if DEVICE == "cuda" else (1, 3)):
        x = _x(rows, 384, torch.bfloat16)
        quantized = DEVICE == "cuda" and rows <= 128
        ref = w8a8_gemm_ref(x, q, s, BLOCK, b) if quantized else x.double() @ weight_only.t() + b.double()
        _check(fp8_linear_op(x, q, s, BLOCK, b, w8a8=True), ref, torch.bfloat16)
