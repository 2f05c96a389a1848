"""FP8 weights (kernels.fp8, and kernels.gemv with scales): the register-dequantizing GEMV and
skinny GEMM, and the dequantize pass, against float64 products of the dequantized weight; the
outputs NaN-poisoned first. Triton's CPU interpreter runs float8_e4m3fn loads and conversions,
so the Triton paths are checked here too (small shapes), and natively on a GPU."""
from __future__ import annotations

import pytest
import torch

from kernels.fp8 import FP8_DTYPE, dequantize_fp8, dequantize_fp8_ref, quantize_fp8_ref, scale_shape
from kernels.gemv import gemv, gemv_ref, skinny_gemm, skinny_gemm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
BLOCK = (128, 128)
# (scales, block): one per row (per-tensor and per-channel checkpoints), or 128 x 128 blocks.
SCHEMES = {"row": None, "block": BLOCK}


def _weight(n: int, k: int, block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(FP8 weight, fp32 scales, the float64 weight they stand for): scales spread over two
    decades so that a scale applied to the wrong block shows."""
    q, s = quantize_fp8_ref(torch.randn(n, k), block)
    s = s * torch.exp(torch.randn(s.shape) * 1.5)
    w64 = q.double() * (s.double()[:, None] if block is None else
                        s.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k])
    return q.to(DEVICE), s.to(DEVICE), w64.to(DEVICE)


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape and torch.isfinite(out).all()
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n,k,cfg", [
    (300, 200, None),  # ragged: a partial last block both ways
    (256, 384, {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1}),  # K steps across blocks
    # each thread's 16 keys summed before the accumulator, three K steps, the last one partial
    (144, 4200, {"BLOCK_N": 16, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 1, "CHUNK": 16}),
])
def test_fp8_gemv(scheme, dtype, n, k, cfg):
    block = SCHEMES[scheme]
    q, s, w64 = _weight(n, k, block)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype)
    ref = torch.nn.functional.linear(x.double(), w64, b.double())
    out = torch.full((1, n), float("nan"), device=DEVICE, dtype=dtype)
    got = gemv(x, q, b, out=out, config=cfg, weight_scale=s, block_size=block)
    assert got.data_ptr() == out.data_ptr()
    _check(got, ref, dtype)
    _check(gemv_ref(x, q, b, weight_scale=s, block_size=block), ref, dtype)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp8_gemv_applies_an_activation(scheme, dtype):
    """The down projection's activation inside the FP8 GEMV (what `fp8_linear_op` does at one
    row): x = gate | up through gelu-tanh, then the block- or row-scaled product; against float64
    and against the activation's launch then the GEMV; and the op at one row and at two."""
    from kernels.activation import fusable, gelu_tanh_and_mul, gelu_tanh_and_mul_ref
    from workers.ops import ACTIVATIONS, fp8_linear_op
    block = SCHEMES[scheme]
    n, k = 144, 4200
    q, s, w64 = _weight(n, k, block)
    x = (2 * torch.randn(1, 2 * k, device=DEVICE)).to(dtype)
    ref = torch.nn.functional.linear(gelu_tanh_and_mul_ref(x.double()), w64)
    cfg = {"BLOCK_N": 16, "BLOCK_K": 2048, "num_warps": 4, "num_stages": 1, "CHUNK": 16}
    out = torch.full((1, n), float("nan"), device=DEVICE, dtype=dtype)
    got = gemv(x, q, out=out, config=cfg, weight_scale=s, block_size=block, act=fusable(gelu_tanh_and_mul))
    _check(got, ref, dtype)
    two_launches = gemv(gelu_tanh_and_mul(x), q, config=cfg, weight_scale=s, block_size=block)
    assert ((got.double() - two_launches.double()).norm() / ref.norm()).item() < TOL[dtype] / 4
    op = ACTIVATIONS["gelu_tanh"]
    _check(fp8_linear_op(x, q, s, block, act=op), ref, dtype)
    _check(fp8_linear_op(torch.cat([x, x]), q, s, block, act=op)[1:], ref, dtype)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("m,n,k,cfg", [
    (3, 300, 200, None),  # ragged
    (17, 256, 256, {"BLOCK_N": 32, "BLOCK_K": 128, "SWAP": True, "num_warps": 4, "num_stages": 2}),
    (5, 128, 384, {"BLOCK_N": 64, "BLOCK_K": 64, "SWAP": False, "num_warps": 4, "num_stages": 2}),
    (40, 200, 256, None),  # FP8 only past 32 rows: a 64-row tile
    (128, 256, 128, None),  # and a full 128-row one
])
def test_fp8_skinny_gemm(scheme, dtype, m, n, k, cfg):
    block = SCHEMES[scheme]
    q, s, w64 = _weight(n, k, block)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    ref = torch.nn.functional.linear(x.double(), w64)
    out = torch.full((m, n), float("nan"), device=DEVICE, dtype=dtype)
    got = skinny_gemm(x, q, out=out, config=cfg, weight_scale=s, block_size=block)
    _check(got, ref, dtype)
    _check(skinny_gemm_ref(x, q, weight_scale=s, block_size=block), ref, dtype)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantize_fp8(scheme):
    block = SCHEMES[scheme]
    q, s, w64 = _weight(200, 300, block)
    out = torch.full((200, 300), float("nan"), device=DEVICE, dtype=torch.float32)
    got = dequantize_fp8(q, s, block, torch.float32, out=out)
    torch.testing.assert_close(got.double(), w64, rtol=1e-6, atol=0)
    torch.testing.assert_close(dequantize_fp8_ref(q, s, block, torch.float64), w64, rtol=1e-12, atol=0)


def test_quantize_fp8_ref_layouts():
    """Each block's (row's, tensor's) largest magnitude lands on 448, the published recipe."""
    w = torch.randn(200, 300)
    for block, per_tensor in ((BLOCK, False), (None, False), (None, True)):
        q, s = quantize_fp8_ref(w, block, per_tensor)
        assert q.dtype == FP8_DTYPE
        assert s.shape == (() if per_tensor else scale_shape(200, 300, block))
        assert q.float().abs().max().item() == 448.0
        back = q.float() * (s if per_tensor else s[:, None] if block is None else
                            s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300])
        assert ((back - w).norm() / w.norm()).item() < 0.05


def test_fp8_bad_arguments():
    q, s, _ = _weight(256, 256, BLOCK)
    x = torch.randn(1, 256, device=DEVICE)
    with pytest.raises(ValueError, match=r"must be \(2, 2\)"):
        gemv(x, q, weight_scale=s[:1], block_size=BLOCK)
    with pytest.raises(TypeError, match="must be torch.float8_e4m3fn"):
        gemv(x, q.float(), weight_scale=s, block_size=BLOCK)
    with pytest.raises(ValueError, match="whole multiples of the tile"):
        q16, s16, _ = _weight(256, 256, (16, 128))
        skinny_gemm(x.expand(2, -1), q16, weight_scale=s16, block_size=(16, 128),
                    config={"BLOCK_N": 32, "BLOCK_K": 128, "SWAP": True, "num_warps": 4, "num_stages": 1})


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_linear_op_routes_by_rows(scheme):
    """The layers' entry point: on a GPU one row through the FP8 GEMV, 2-128 through the skinny
    GEMM, more dequantized for cuBLAS; on CPU the references. The same numbers every way."""
    from workers.ops import fp8_linear_op
    block = SCHEMES[scheme]
    q, s, w64 = _weight(256, 384, block)
    b = torch.randn(256, device=DEVICE)
    for rows in (1, 3, 33, 128, 129):
        x = torch.randn(rows, 384, device=DEVICE)
        _check(fp8_linear_op(x, q, s, block, b), torch.nn.functional.linear(x.double(), w64, b.double()),
               torch.float32)
