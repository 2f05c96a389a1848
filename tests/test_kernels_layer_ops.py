"""Layer ops (KV store, RMSNorm, rotary, gated activations): Triton kernels and their torch
references against a float64 evaluation of the reference, on fresh random inputs, with outputs
poisoned so unwritten elements fail. Kernels run under TRITON_INTERPRET=1 without a GPU
(tests/conftest.py), so shapes are small."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.activation import (relu2, relu2_ref, gelu_tanh_and_mul, gelu_tanh_and_mul_ref, sigmoid_gate_mul,
                                sigmoid_gate_mul_ref, silu_and_mul, silu_and_mul_ref,
                                swiglu_oai_and_mul, swiglu_oai_and_mul_ref)
from kernels.gated_rmsnorm import GatedRMSNorm, gated_rms_norm, gated_rms_norm_ref
from kernels.gemv import (NORM_MAX_COLUMNS, NORM_MAX_GROUP, SKINNY_MAX_ROWS, fuses_gated_norm, gemv, gemv_ref,
                          skinny_config, skinny_gemm, skinny_gemm_ref)
from kernels.kv_store import FP8_DTYPE, KVWrite, store_kv, store_kv_ref
from kernels.layernorm import rms_norm, rms_norm_ref
from kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref
from kernels.rotary import make_rope_cache, rope_inv_freq, rotary_embedding, rotary_embedding_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# ||out - ref|| / ||ref|| bound per operand dtype (a few ulps of the output dtype)
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output (unwritten or poisoned elements)"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == dtype
    err = rel_err(out, ref)
    assert err < TOL[dtype], err


def randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype)


# ----------------------------------------------------------------------------- KV store

def _slots(num_tokens: int, num_blocks: int, block_size: int, n_skip: int) -> torch.Tensor:
    """Distinct slots in shuffled, non-contiguous blocks (never block 0), `n_skip` of them -1."""
    blocks = torch.randperm(num_blocks - 1)[: math.ceil(num_tokens / block_size) + 2] + 1
    cand = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    slots = cand[torch.randperm(cand.numel())[:num_tokens]]
    slots[torch.randperm(num_tokens)[:n_skip]] = -1
    return slots.to(DEVICE, torch.int64)


@pytest.mark.parametrize("impl", [store_kv, store_kv_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,num_heads,strided", [(64, 3, False), (128, 2, True), (256, 1, True), (96, 2, False), (256, 10, True),
                                                    (512, 2, True)])
def test_store_kv(impl, dtype, head_dim, num_heads, strided):
    num_tokens, block_size, num_blocks = 13, 4, 12
    key, value = randn(num_tokens, num_heads, head_dim, dtype=dtype), randn(num_tokens, num_heads, head_dim, dtype=dtype)
    shape = (num_blocks, 2, block_size, num_heads, head_dim)
    if strided:  # a layer's view of a group buffer holding 3 layers: [blocks, layer, 2, B, H, D]
        buf = torch.full((num_blocks, 3, *shape[1:]), float("nan"), device=DEVICE, dtype=dtype)
        cache = buf[:, 1]
        assert not cache.is_contiguous()
    else:
        buf = cache = torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)
    slots = _slots(num_tokens, num_blocks, block_size, n_skip=4)
    impl(key, value, cache, slots)
    keep = slots >= 0
    blk, off = slots[keep] // block_size, slots[keep] % block_size
    torch.testing.assert_close(cache[blk, 0, off], key[keep], rtol=0, atol=0)
    torch.testing.assert_close(cache[blk, 1, off], value[keep], rtol=0, atol=0)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    written[blk, off] = True
    assert cache.isnan().all(-1).all(-1).permute(0, 2, 1)[written].logical_not().all()
    assert cache.permute(0, 2, 1, 3, 4)[~written].isnan().all(), "untouched slot was written"
    if strided:
        others = torch.cat([buf[:, 0], buf[:, 2]])
        assert others.isnan().all(), "wrote outside the layer's view"


# ----------------------------------------------------------------------------- RMSNorm

@pytest.mark.parametrize("impl", [rms_norm, rms_norm_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 200, 1024])
@pytest.mark.parametrize("fused_add", [False, True], ids=["plain", "add"])
@pytest.mark.parametrize("gemma", [False, True], ids=["w", "1+w"])
@pytest.mark.parametrize("pre", [False, True], ids=["", "pre-norm"])
def test_rms_norm(impl, dtype, hidden, fused_add, gemma, pre):
    num_tokens, eps = 9, 1e-6
    x = randn(num_tokens, hidden, dtype=dtype) * 3
    weight = (1 + 0.2 * torch.randn(hidden, device=DEVICE)).to(dtype)
    pre_weight = (1 + 0.2 * torch.randn(hidden, device=DEVICE)).to(dtype) if pre else None
    residual = randn(num_tokens, hidden, dtype=dtype) if fused_add else None
    x_in, res_in = x.clone(), None if residual is None else residual.clone()
    got = impl(x, weight, eps, residual=residual, gemma=gemma, pre_weight=pre_weight)
    ref = rms_norm_ref(x.double(), weight.double(), eps, residual=None if residual is None else residual.double(),
                       gemma=gemma, pre_weight=None if pre_weight is None else pre_weight.double())
    assert torch.equal(x, x_in) and (residual is None or torch.equal(residual, res_in)), "inputs modified"
    if fused_add:
        check(got[1], ref[1], dtype)
        check(got[0], ref[0], dtype)
    else:
        check(got, ref, dtype)


@pytest.mark.parametrize("impl", [rms_norm, rms_norm_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_pre_norm_equals_two_norms(impl, dtype):
    """The fused first norm gives the bits of the two launches it replaces (a model's tokens do
    not depend on the fusion). In the 16-bit dtypes the first norm's output is rounded before the
    add; in fp32 nothing separates them and the GPU compiler may contract them into one FMA (an
    ulp apart, as measured on an H200), so fp32 is held to the float64 oracle above instead."""
    x, residual = randn(7, 256, dtype=dtype) * 3, randn(7, 256, dtype=dtype)
    w, pw = ((1 + 0.2 * torch.randn(256, device=DEVICE)).to(dtype) for _ in range(2))
    fused = impl(x, w, 1e-6, residual, gemma=True, pre_weight=pw)
    plain = impl(impl(x, pw, 1e-6, gemma=True), w, 1e-6, residual, gemma=True)
    assert torch.equal(fused[0], plain[0]) and torch.equal(fused[1], plain[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pre", [False, True], ids=["", "pre-norm"])
def test_the_launch_before_a_dense_projection_gives_the_same_bits(dtype, pre):
    """`feeds_dense_projection` moves the residual's load before the PDL wait and the next
    kernel's launch to the exit; the outputs are the default launch's, bit for bit."""
    x, residual = randn(5, 3840, dtype=dtype) * 3, randn(5, 3840, dtype=dtype)
    w, pw = ((1 + 0.2 * torch.randn(3840, device=DEVICE)).to(dtype) for _ in range(2))
    pw = pw if pre else None
    default = rms_norm(x, w, 1e-6, residual, gemma=True, pre_weight=pw)
    dense = rms_norm(x, w, 1e-6, residual, gemma=True, pre_weight=pw, feeds_dense_projection=True)
    ref = rms_norm_ref(x.double(), w.double(), 1e-6, residual.double(), gemma=True,
                       pre_weight=None if pw is None else pw.double())
    check(dense[0], ref[0], dtype)
    assert torch.equal(dense[0], default[0]) and torch.equal(dense[1], default[1])


def test_rms_norm_leading_dims_and_strided_rows():
    x = randn(5, 3, 2 * 128, dtype=torch.bfloat16)[..., :128]  # [5, 3, 128], row stride 256
    w = randn(128, dtype=torch.bfloat16)
    check(rms_norm(x, w, 1e-5), rms_norm_ref(x.double(), w.double(), 1e-5), torch.bfloat16)


# ----------------------------------------------------------------------------- rotary

@pytest.mark.parametrize("impl", [rotary_embedding, rotary_embedding_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,rotary_dim,n_q,n_k", [(64, 64, 4, 2), (128, 128, 4, 2), (128, 64, 4, 2), (256, 256, 4, 2),
                                                        (256, 64, 4, 2), (80, 80, 4, 2), (256, 128, 20, 4),
                                                        (512, 512, 8, 1)])
def test_rotary(impl, dtype, head_dim, rotary_dim, n_q, n_k):
    """(256, 128, 20, 4): several head tiles per token, some with q heads only."""
    num_tokens, max_pos = 11, 4096
    # q and k are views of a fused qkv output, as the attention layer hands them over
    qkv = randn(num_tokens, (n_q + 2 * n_k) * head_dim, dtype=dtype)
    q = qkv[:, : n_q * head_dim].view(num_tokens, n_q, head_dim)
    k = qkv[:, n_q * head_dim: (n_q + n_k) * head_dim].view(num_tokens, n_k, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,), device=DEVICE)
    cache = make_rope_cache(rotary_dim, max_pos, 10000.0, None, torch.float32, DEVICE)
    before = qkv.clone()
    q_ref, k_ref = rotary_embedding_ref(q.double(), k.double(), positions, cache)
    q_out, k_out = impl(q, k, positions, cache)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), "not in place"
    check(q, q_ref, dtype)
    check(k, k_ref, dtype)
    qkv3 = qkv.view(num_tokens, n_q + 2 * n_k, head_dim)
    b3 = before.view_as(qkv3)
    assert torch.equal(qkv3[:, : n_q + n_k, rotary_dim:], b3[:, : n_q + n_k, rotary_dim:]), "pass-through changed"
    assert torch.equal(qkv3[:, n_q + n_k:], b3[:, n_q + n_k:]), "v was touched"
    assert not torch.equal(qkv3[:, :, :rotary_dim], b3[:, :, :rotary_dim])


@pytest.mark.parametrize("impl", [rotary_embedding, rotary_embedding_ref], ids=["triton", "torch"])
def test_rotary_q_only_and_rotation_property(impl):
    """k=None is allowed; position 0 is the identity and every (i, i + D/2) pair keeps its norm."""
    q = randn(7, 3, 128, dtype=torch.float32)
    cache = make_rope_cache(128, 64, 10000.0)
    positions = torch.tensor([0, 1, 63, 5, 0, 2, 9], device=DEVICE)
    q0 = q.clone()
    impl(q, None, positions, cache.to(DEVICE))
    torch.testing.assert_close(q[positions == 0], q0[positions == 0])
    torch.testing.assert_close(q[..., :64] ** 2 + q[..., 64:] ** 2, q0[..., :64] ** 2 + q0[..., 64:] ** 2)


# ----------------------------------------------------------------------------- rope caches vs transformers

def _hf_config(head_dim: int, base: float, rope_scaling: dict | None, max_pos: int):
    from transformers import LlamaConfig
    params = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": base}
    try:  # transformers >= 5: rope_parameters carries theta and scaling
        cfg = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                          max_position_embeddings=max_pos, rope_parameters=params)
        assert cfg.rope_parameters["rope_theta"] == base
    except (TypeError, AssertionError, KeyError):  # older: rope_theta + rope_scaling
        cfg = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
                          max_position_embeddings=max_pos, rope_theta=base, rope_scaling=rope_scaling)
    return cfg


def _hf_inv_freq(head_dim: int, base: float, rope_scaling: dict | None, max_pos: int):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = _hf_config(head_dim, base, rope_scaling, max_pos)
    kind = (rope_scaling or {}).get("rope_type", "default")
    if kind in ROPE_INIT_FUNCTIONS:
        inv, scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
        return inv, scale
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # "default" lives here in v5
    emb = LlamaRotaryEmbedding(cfg)
    return emb.inv_freq, emb.attention_scaling


ROPE_CASES = {
    "default": (128, 10000.0, None, 4096),
    "default_hd64": (64, 1_000_000.0, None, 4096),
    "linear": (128, 10000.0, {"rope_type": "linear", "factor": 4.0}, 8192),
    "llama3": (128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 131072),
    "yarn": (128, 10000.0, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, 16384),
    "yarn_attn_factor": (64, 1_000_000.0, {"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.8,
                                           "beta_fast": 16, "beta_slow": 2,
                                           "original_max_position_embeddings": 32768}, 131072),
    # Gemma 4's full layers: a quarter of the head's frequencies (over the whole head), the rest 0.
    "proportional": (512, 1_000_000.0, {"rope_type": "proportional", "partial_rotary_factor": 0.25}, 4096),
    "proportional_factor": (256, 10000.0, {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                           "factor": 2.0}, 4096),
    "yarn_mscale": (64, 10000.0, {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                                  "original_max_position_embeddings": 4096}, 163840),
}


@pytest.mark.parametrize("case", list(ROPE_CASES))
def test_rope_cache_matches_transformers(case):
    head_dim, base, scaling, max_pos = ROPE_CASES[case]
    hf_inv, hf_scale = _hf_inv_freq(head_dim, base, scaling, max_pos)
    inv, scale = rope_inv_freq(head_dim, base, scaling, max_pos)
    torch.testing.assert_close(inv, hf_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(hf_scale, rel=1e-9)
    n = 2048
    cache = make_rope_cache(head_dim, n, base, scaling)
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), hf_inv.float())
    torch.testing.assert_close(cache, torch.cat([freqs.cos(), freqs.sin()], -1) * hf_scale, rtol=1e-5, atol=1e-6)
    if scaling is not None:  # scaling actually changed something
        assert not torch.allclose(cache, make_rope_cache(head_dim, n, base, None))


def test_rope_cache_type_key_alias():
    a = make_rope_cache(64, 16, 10000.0, {"type": "linear", "factor": 2.0})
    b = make_rope_cache(64, 16, 10000.0, {"rope_type": "linear", "factor": 2.0})
    assert torch.equal(a, b)


def test_gemma3_two_bases_two_caches():
    """Gemma-3: sliding layers use base 10_000, global layers 1_000_000: two caches."""
    local = make_rope_cache(64, 256, 10_000.0)
    glob = make_rope_cache(64, 256, 1_000_000.0)
    assert not torch.allclose(local, glob)
    try:
        from transformers import Gemma3TextConfig
        from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
        cfg = Gemma3TextConfig(head_dim=64, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
        emb = Gemma3RotaryEmbedding(cfg)
        hf = {lt: getattr(emb, f"{lt}_inv_freq") for lt in ("sliding_attention", "full_attention")}
        bases = {lt: cfg.rope_parameters[lt]["rope_theta"] for lt in hf}
    except (ImportError, AttributeError, TypeError, KeyError):
        pytest.skip("this transformers has no per-layer-type Gemma-3 rope")
    assert bases == {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}
    torch.testing.assert_close(rope_inv_freq(64, 10_000.0)[0], hf["sliding_attention"].float(), rtol=1e-6, atol=0)
    torch.testing.assert_close(rope_inv_freq(64, 1_000_000.0)[0], hf["full_attention"].float(), rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- activations

@pytest.mark.parametrize("impl,ref", [(silu_and_mul, silu_and_mul_ref), (silu_and_mul_ref, silu_and_mul_ref),
                                      (gelu_tanh_and_mul, gelu_tanh_and_mul_ref),
                                      (gelu_tanh_and_mul_ref, gelu_tanh_and_mul_ref)],
                         ids=["silu-triton", "silu-torch", "gelu-triton", "gelu-torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [64, 200, 1536])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # interpreter (numpy) saturating exp
def test_act_and_mul(impl, ref, dtype, inter):
    x = randn(7, 2 * inter, dtype=dtype) * 4  # wide range: exercises exp saturation in both tails
    x[0, :8] = torch.tensor([-100.0, -30.0, -9.0, 0.0, 9.0, 30.0, 100.0, 1e-3], dtype=dtype)
    out = impl(x)
    check(out, ref(x.double()), dtype)


@pytest.mark.parametrize("impl", [swiglu_oai_and_mul, swiglu_oai_and_mul_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_oai_and_mul(impl, dtype):
    """gpt-oss's clamped gate: against the formula evaluated in float64 here, with gates and ups
    on both sides of the clamps."""
    x = randn(7, 2 * 160, dtype=dtype) * 6
    x[0, :6] = torch.tensor([-100.0, -8.0, 6.9, 7.0, 7.5, 100.0], dtype=dtype)
    x[0, 160:166] = torch.tensor([-100.0, -7.5, -6.0, 7.0, 7.5, 100.0], dtype=dtype)
    g, u = x.double()[:, :160].clamp(max=7.0), x.double()[:, 160:].clamp(-7.0, 7.0)
    check(impl(x, 1.702, 7.0), g * torch.sigmoid(1.702 * g) * (u + 1), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_sigmoid_gate_mul(dtype):
    """An attention's output gate over a strided view of the projection (as the layer passes it):
    its float64 value within the usual bound, and on a GPU torch's own x * sigmoid(z) within an
    ulp of the sigmoid's rounding (`tl.exp` is not torch's exp; the interpreter rounds to bf16 by
    truncation)."""
    x = randn(9, 1500, dtype=dtype) * 3
    wide = randn(9, 2 * 1500 + 7, dtype=dtype) * 4
    z = wide[:, 7:1507]
    z[0, :6] = torch.tensor([-100.0, -30.0, 0.0, 1e-3, 30.0, 100.0], dtype=dtype)
    got = sigmoid_gate_mul(x, z)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    check(got, x.double() * torch.sigmoid(z.double()), dtype)
    if DEVICE == "cuda":
        torch.testing.assert_close(got, sigmoid_gate_mul_ref(x, z), rtol={torch.float32: 1e-6}.get(dtype, 8e-3),
                                   atol=1e-6)
    assert sigmoid_gate_mul(x[:0], z[:0]).shape == (0, 1500)


def test_act_and_mul_strided_rows():
    x = randn(5, 2 * 256, dtype=torch.bfloat16)
    wide = torch.full((5, 3 * 256), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    wide[:, :512] = x
    view = wide[:, :512]
    check(silu_and_mul(view), silu_and_mul_ref(x.double()), torch.bfloat16)
    check(gelu_tanh_and_mul(view), gelu_tanh_and_mul_ref(x.double()), torch.bfloat16)


@pytest.mark.parametrize("impl", [relu2, relu2_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_relu2(impl, dtype):
    """Nemotron-H's ungated relu^2 against float64, on a row-strided view whose neighbouring
    columns are NaN (a kernel that read past a row's I columns would return NaN)."""
    x = randn(7, 200, dtype=dtype) * 4
    x[0, :5] = torch.tensor([-100.0, -1e-3, 0.0, 1e-3, 100.0], dtype=dtype)
    wide = torch.full((7, 256), float("nan"), device=DEVICE, dtype=dtype)
    wide[:, :200] = x
    out = impl(wide[:, :200])
    assert out.shape == (7, 200) and out.dtype == dtype
    check(out, torch.relu(x.double()) ** 2, dtype)


# ----------------------------------------------------------------------------- fused q/k norm + rotary

@pytest.mark.parametrize("impl", [qk_norm_rope, qk_norm_rope_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,rotary_dim,n_q,n_k,gemma", [(64, 64, 4, 2, True), (128, 128, 8, 2, False),
                                                               (256, 256, 16, 8, True), (80, 80, 3, 1, False),
                                                               (256, 256, 20, 4, False), (512, 512, 8, 1, False),
                                                               (256, 64, 8, 2, True), (80, 16, 3, 1, False),
                                                               (128, 96, 4, 2, False)])
def test_qk_norm_rope(impl, dtype, head_dim, rotary_dim, n_q, n_k, gemma):
    """Against norm-then-rotate evaluated in float64, in place on views of a fused qkv output; v
    untouched; several head tiles per token where Hq is large; partial rotary (Qwen3-Next's
    quarter of each head; widths that are not powers of two)."""
    num_tokens, max_pos = 9, 2048
    qkv = randn(num_tokens, (n_q + 2 * n_k) * head_dim, dtype=dtype) * 3
    q = qkv[:, : n_q * head_dim].view(num_tokens, n_q, head_dim)
    k = qkv[:, n_q * head_dim: (n_q + n_k) * head_dim].view(num_tokens, n_k, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,), device=DEVICE)
    cache = make_rope_cache(rotary_dim, max_pos, 10000.0, None, torch.float32, DEVICE)
    qw, kw = randn(head_dim, dtype=dtype), randn(head_dim, dtype=dtype)
    before = qkv.clone()
    q_ref, k_ref = qk_norm_rope_ref(q.double(), k.double(), positions, cache, qw.double(), kw.double(), 1e-6, gemma)
    q_out, k_out = impl(q, k, positions, cache, qw, kw, 1e-6, gemma)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), "not in place"
    check(q, q_ref, dtype)
    check(k, k_ref, dtype)
    assert torch.equal(qkv[:, (n_q + n_k) * head_dim:], before[:, (n_q + n_k) * head_dim:]), "v was touched"


def test_qk_norm_rope_equals_the_unfused_kernels():
    """Fused and unfused give the same numbers, up to the order of one fp32 sum (the norm's
    output is rounded where the unfused path stores it)."""
    for dtype in (torch.bfloat16, torch.float32):
        n, hq, hk, d = 7, 4, 2, 128
        qkv = randn(n, (hq + 2 * hk) * d, dtype=dtype)
        cache = make_rope_cache(d, 64, 1e4, None, torch.float32, DEVICE)
        pos = torch.randint(0, 64, (n,), device=DEVICE)
        qw, kw = randn(d, dtype=dtype), randn(d, dtype=dtype)
        a = qkv.clone()
        qa, ka = a[:, :hq * d].view(n, hq, d), a[:, hq * d:(hq + hk) * d].view(n, hk, d)
        qk_norm_rope(qa, ka, pos, cache, qw, kw, 1e-6, True)
        b = qkv.clone()
        qb, kb = b[:, :hq * d].view(n, hq, d), b[:, hq * d:(hq + hk) * d].view(n, hk, d)
        qn, kn = rms_norm(qb, qw, 1e-6, gemma=True), rms_norm(kb, kw, 1e-6, gemma=True)
        rotary_embedding(qn, kn, pos, cache)
        tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(qa, qn, **tol)
        torch.testing.assert_close(ka, kn, **tol)
    for bad in (cache[:, :63], make_rope_cache(2 * d, 64, 1e4, None, torch.float32, DEVICE)):
        with pytest.raises(ValueError, match="even rotary width up to the head size"):
            qk_norm_rope(qa, ka, pos, bad, qw, kw, 1e-6)


def _kv_write(n: int, hk: int, d: int, dtype: torch.dtype, cache_dtype: torch.dtype, n_skip: int) -> KVWrite:
    """Values and a NaN-filled (bytes 0x7F for fp8) strided cache view (a layer of a three-layer
    group buffer), slots in shuffled blocks with `n_skip` of them -1."""
    num_blocks, block_size = 8, 4
    buf = torch.full((num_blocks, 3, 2, block_size, hk, d), float("nan"), device=DEVICE, dtype=torch.float32)
    buf = buf.to(cache_dtype) if cache_dtype != FP8_DTYPE else torch.full(buf.shape, 0x7F, dtype=torch.uint8,
                                                                          device=DEVICE).view(FP8_DTYPE)
    scales = {}
    if cache_dtype == FP8_DTYPE:
        scales = dict(k_scale=torch.tensor([0.37], device=DEVICE), v_scale=torch.tensor([1.9], device=DEVICE))
    return KVWrite(randn(n, hk, d, dtype=dtype), buf[:, 1], _slots(n, num_blocks, block_size, n_skip), **scales)


@pytest.mark.parametrize("fused", ["qk_norm_rope", "rotary"])
@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                               (torch.bfloat16, FP8_DTYPE), (torch.float16, FP8_DTYPE)], ids=str)
@pytest.mark.parametrize("head_dim,rotary_dim,n_q,n_k", [(64, 64, 4, 2), (256, 64, 8, 2), (80, 48, 3, 1),
                                                         (512, 512, 8, 1)])
def test_rotary_stores_the_kv(fused, impl, dtype, cache_dtype, head_dim, rotary_dim, n_q, n_k):
    """A rotary launch given a `KVWrite` stores exactly what `store_kv` stores of the keys it
    wrote and of the values (the same bytes, in an fp8 cache too), skips slots of -1 and writes
    nothing else; q and k come out as without it, up to the GPU compiler's contraction of a
    product and a sum into one FMA, which may differ between the two compiled launches (on an
    H200, fp16 heads of 512: 2 of 41,472 elements a few ulps apart, from the norm's rounding)."""
    n, max_pos = 9, 512
    qkv = randn(n, (n_q + n_k) * head_dim, dtype=dtype) * 3
    cache = make_rope_cache(rotary_dim, max_pos, 10000.0, None, torch.float32, DEVICE)
    positions = torch.randint(0, max_pos, (n,), device=DEVICE)
    qw, kw = randn(head_dim, dtype=dtype), randn(head_dim, dtype=dtype)
    kv = _kv_write(n, n_k, head_dim, dtype, cache_dtype, n_skip=3)
    expect = KVWrite(kv.value, kv.kv_cache.clone(), kv.slot_mapping, kv.k_scale, kv.v_scale)
    plain, stored = qkv.clone(), qkv.clone()
    if fused == "qk_norm_rope":
        op = qk_norm_rope if impl == "triton" else qk_norm_rope_ref
        run = lambda t, w: op(t[:, :n_q * head_dim].view(n, n_q, head_dim),  # noqa: E731
                              t[:, n_q * head_dim:].view(n, n_k, head_dim), positions, cache, qw, kw, 1e-6, True,
                              kv_write=w)
    else:
        op = rotary_embedding if impl == "triton" else rotary_embedding_ref
        run = lambda t, w: op(t[:, :n_q * head_dim].view(n, n_q, head_dim),  # noqa: E731
                              t[:, n_q * head_dim:].view(n, n_k, head_dim), positions, cache, kv_write=w)
    run(plain, None)
    run(stored, kv)
    assert rel_err(stored, plain) < TOL[dtype] / 10
    store = store_kv if impl == "triton" else store_kv_ref
    store(stored[:, n_q * head_dim:].view(n, n_k, head_dim), expect.value, expect.kv_cache, expect.slot_mapping,
          expect.k_scale, expect.v_scale)
    assert torch.equal(kv.kv_cache.view(torch.uint8) if cache_dtype == FP8_DTYPE else kv.kv_cache.nan_to_num(7.0),
                       expect.kv_cache.view(torch.uint8) if cache_dtype == FP8_DTYPE
                       else expect.kv_cache.nan_to_num(7.0)), "the cache differs from store_kv's"
    if cache_dtype != FP8_DTYPE:
        buf = kv.kv_cache._base if kv.kv_cache._base is not None else kv.kv_cache
        others = torch.cat([buf[:, 0], buf[:, 2]])
        assert others.isnan().all(), "wrote outside the layer's view"
        assert kv.kv_cache.isnan().any(), "every slot written: the skipped ones too"


def test_rotary_kv_write_refusals():
    q, k = randn(3, 2, 64, dtype=torch.bfloat16), randn(3, 1, 64, dtype=torch.bfloat16)
    cache = make_rope_cache(64, 16, 1e4, None, torch.float32, DEVICE)
    pos = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    kv = _kv_write(3, 1, 64, torch.bfloat16, torch.bfloat16, n_skip=0)
    for op in (rotary_embedding, rotary_embedding_ref):
        with pytest.raises(ValueError, match="needs the keys"):
            op(q, None, pos, cache, kv_write=kv)
    fp8 = _kv_write(3, 1, 64, torch.bfloat16, FP8_DTYPE, n_skip=0)
    no_scales = KVWrite(fp8.value, fp8.kv_cache, fp8.slot_mapping)
    for op in (rotary_embedding, lambda *a, **kw: qk_norm_rope(*a[:4], k[0, 0], k[0, 0], 1e-6, **kw)):
        with pytest.raises(ValueError, match="k_scale"):
            op(q, k, pos, cache, kv_write=no_scales)


# ----------------------------------------------------------------------------- single-row GEMV

def _nan_padded_rows(rows: int, cols: int, pad: int, dtype: torch.dtype) -> torch.Tensor:
    """Random [rows, cols] as a view of a wider matrix whose other `pad` columns are NaN: a kernel
    that reads past a row's end (or ignores the row stride) poisons its output."""
    wide = torch.full((rows, cols + pad), float("nan"), device=DEVICE, dtype=dtype)
    wide[:, :cols] = randn(rows, cols, dtype=dtype)
    return wide[:, :cols]


@pytest.mark.parametrize("impl", [gemv, gemv_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k,cfg", [
    (37, 300, None),  # ragged N and K: masked rows and a partial last K step
    (64, 1024, None),
    (21, 700, {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}),
    (50, 513, {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4, "num_stages": 1}),
    # runs of 16 keys summed before the accumulator, three K steps, the last one partial
    (50, 2600, {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1, "CHUNK": 16}),
])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_gemv(impl, dtype, n, k, cfg, bias):
    """Against float64 F.linear on a weight whose rows are strided (a view of a wider matrix, the
    rest NaN), output poisoned with NaN first."""
    x = randn(1, k, dtype=dtype)
    w = _nan_padded_rows(n, k, 24, dtype)
    b = randn(n, dtype=dtype) if bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    if impl is gemv:
        out = torch.full((1, n), float("nan"), device=DEVICE, dtype=dtype)
        got = gemv(x, w, b, out=out, config=cfg)
        assert got.data_ptr() == out.data_ptr()
    else:
        got = impl(x, w, b)
    check(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemv_past_the_first_tile_rule(dtype):
    """N past 4,096 columns, the default tiles of wide outputs (their 500-1,000 programs are slow
    under the interpreter: one case a dtype, with a bias)."""
    x = randn(1, 96, dtype=dtype)
    w = _nan_padded_rows(4100, 96, 24, dtype)
    b = randn(4100, dtype=dtype)
    out = torch.full((1, 4100), float("nan"), device=DEVICE, dtype=dtype)
    check(gemv(x, w, b, out=out), torch.nn.functional.linear(x.double(), w.double(), b.double()), dtype)


@pytest.mark.parametrize("impl", [gemv, gemv_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group,k,n,cfg", [
    (128, 512, 40, None),  # Gated DeltaNet heads: several groups a K step
    (64, 320, 21, {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}),  # a partial last step
    (128, 640, 37, {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}),  # groups wider than the step
    (128, 2304, 24, {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1, "CHUNK": 16}),  # runs of 16
])
@pytest.mark.parametrize("before,rounded", [(False, False), (True, True)], ids=["gate-first", "norm-first"])
def test_gemv_applies_a_gated_norm(impl, dtype, group, k, n, cfg, before, rounded):
    """The output projection's prologue: gemv(y, W, norm=) against float64 F.linear of the
    float64 gated norm of y, the gate a strided view inside a wider row (NaN around it), the
    weight's rows strided, output poisoned; and against the two launches it replaces."""
    y, nw = randn(1, k, dtype=dtype), randn(k, dtype=dtype)
    wide = torch.full((1, k + 9), float("nan"), device=DEVICE, dtype=dtype)
    wide[:, 4:4 + k] = randn(1, k, dtype=dtype)
    z = wide[:, 4:4 + k]
    w = _nan_padded_rows(n, k, 24, dtype)
    norm = GatedRMSNorm(z, nw, group, 1e-5, before, rounded)
    normed = gated_rms_norm_ref(y.double(), z.double(), nw.double(), group, 1e-5, before, rounded)
    ref = torch.nn.functional.linear(normed, w.double())
    if impl is gemv:
        out = torch.full((1, n), float("nan"), device=DEVICE, dtype=dtype)
        got = gemv(y, w, out=out, config=cfg, norm=norm)
        assert got.data_ptr() == out.data_ptr()
        check(got, gemv(gated_rms_norm(y, z, nw, group, 1e-5, before, rounded), w, config=cfg).float(), dtype)
    else:
        got = impl(y, w, norm=norm)
    # the normed input is rounded to dtype once or twice before the product (Triton's interpreter
    # truncates to bf16): twice the bound of a product of exact inputs
    assert got.shape == ref.shape and got.dtype == dtype
    assert rel_err(got, ref) < 2 * TOL[dtype]


def test_gemv_refuses_a_norm_it_cannot_take():
    from workers.ops import linear_op
    y, w = randn(1, 192, dtype=torch.float32), randn(8, 192, dtype=torch.float32)
    z, nw = randn(1, 192, dtype=torch.float32), randn(192, dtype=torch.float32)
    with pytest.raises(ValueError, match="power-of-two groups"):
        gemv(y, w, norm=GatedRMSNorm(z, nw, 96, 1e-5))
    with pytest.raises(ValueError, match="power-of-two groups"):
        gemv(y, w, norm=GatedRMSNorm(z, nw, 2 * NORM_MAX_GROUP, 1e-5))
    with pytest.raises(ValueError, match="must divide K"):
        gemv(y, w, norm=GatedRMSNorm(z, nw, 128, 1e-5))
    with pytest.raises(ValueError, match="gate must be"):
        gemv(y, w, norm=GatedRMSNorm(z[:, :64], nw, 64, 1e-5))
    with pytest.raises(ValueError, match="norm's weight"):
        gemv(y, w, norm=GatedRMSNorm(z, nw[:64], 64, 1e-5))
    # which norms the layers' one-row products leave to the GEMV: groups it takes, outputs up to
    # NORM_MAX_COLUMNS wide (wider ones run the norm in its own launch, as measured)
    assert fuses_gated_norm(GatedRMSNorm(z, nw, 64, 1e-5), NORM_MAX_COLUMNS)
    assert not fuses_gated_norm(GatedRMSNorm(z, nw, 64, 1e-5), NORM_MAX_COLUMNS + 1)
    assert not fuses_gated_norm(GatedRMSNorm(z, nw, 96, 1e-5), 8)
    # the layers' entry point runs such a norm first instead
    norm = GatedRMSNorm(z, nw, 96, 1e-5)
    torch.testing.assert_close(linear_op(y, w, norm=norm), torch.nn.functional.linear(norm.apply(y, ref=True), w),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.gpu  # cuBLAS
@pytest.mark.parametrize("rows", [64, 128, 256, 257], ids=str)
@pytest.mark.parametrize("n,k", [(2048, 16384), (1024, 16384), (4096, 4096)], ids=["long-K", "small", "square"])
def test_linear_op_long_reductions_through_cublaslt(rows, n, k):
    """Decode batches' products with a large weight and K >= 2N go through cuBLASLt
    (`_long_reduction`), the others through cuBLAS; either way the product of the fp64 reference
    to bf16's bound, into `out` when given, and torch's BLAS preference is back as it was."""
    from workers.ops import _long_reduction, linear_op
    before = torch.backends.cuda.preferred_blas_library()
    x, w, b = randn(rows, k, dtype=torch.bfloat16), randn(n, k, dtype=torch.bfloat16), randn(n, dtype=torch.bfloat16)
    assert _long_reduction(x, w) == (rows <= 256 and n == 2048)
    ref = x.double() @ w.double().t()
    out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16, device=x.device)
    for got in (linear_op(x, w), linear_op(x, w, out=out), linear_op(x, w, b) - b):
        assert rel_err(got, ref) < TOL[torch.bfloat16]
    assert torch.backends.cuda.preferred_blas_library() == before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("k,n,start,d,width,bias,cfg", [
    (64, 40, 0, 24, 4, False, None),  # the Gated DeltaNet's q, k, v first
    (96, 53, 11, 30, 4, True, {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}),  # Mamba's x, B, C
    (128, 37, 5, 32, 3, False, {"BLOCK_N": 8, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1, "CHUNK": 16}),
])
@pytest.mark.parametrize("pages", [(3, 3), (2, 5), (0, 4), (6, 0)], ids=["in-place", "moved", "no-state", "no-write"])
def test_gemv_applies_a_conv_step(dtype, k, n, start, d, width, bias, cfg, pages):
    """The input projection's epilogue: gemv(x, W, conv=) against the product followed by the
    conv's own kernel (the same state written, and in bf16 the same numbers bit for bit), and against
    float64 through both references; output poisoned, the other pages (NaN) untouched."""
    from kernels.mamba_conv import ConvStep, causal_conv1d_update
    x, w = randn(1, k, dtype=dtype), _nan_padded_rows(n, k, 24, dtype)
    cw, cb = randn(d, width, dtype=dtype), randn(d, dtype=dtype) if bias else None
    state = torch.full((7, width - 1, d), float("nan"), device=DEVICE, dtype=dtype)
    state[1:] = randn(6, width - 1, d, dtype=dtype)
    init, write = (torch.tensor([p], device=DEVICE, dtype=torch.int32) for p in pages)
    want_state = state.clone()
    want = gemv(x, w, config=cfg)
    causal_conv1d_update(want[:, start:start + d], cw, cb, want_state, init, write, out=want[:, start:start + d])
    ref_state = state.double()
    ref = gemv_ref(x.double(), w.double(), conv=ConvStep(cw.double(), None if cb is None else cb.double(), ref_state,
                                                         init, write, start=start))
    out = torch.full((1, n), float("nan"), device=DEVICE, dtype=dtype)
    got = gemv(x, w, out=out, config=cfg, conv=ConvStep(cw, cb, state, init, write, start=start))
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(state.nan_to_num(7.0), want_state.nan_to_num(7.0))
    if dtype == torch.float32:  # the compiler may contract the taps' products otherwise in each kernel
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)
    assert rel_err(got, ref) < 2 * TOL[dtype]
    assert rel_err(state[1:].double(), ref_state[1:]) < TOL[dtype]


def test_gemv_refuses_a_conv_it_cannot_take():
    from kernels.mamba_conv import ConvStep
    x, w = randn(1, 16, dtype=torch.float32), randn(12, 16, dtype=torch.float32)
    cw, state = randn(8, 4, dtype=torch.float32), randn(3, 3, 8, dtype=torch.float32)
    page = torch.ones(1, device=DEVICE, dtype=torch.int32)
    with pytest.raises(ValueError, match="outside the product"):
        gemv(x, w, conv=ConvStep(cw, None, state, page, page, start=5))
    with pytest.raises(ValueError, match="a write page per row"):
        gemv(x, w, conv=ConvStep(cw, None, state, page.repeat(2), page))
    with pytest.raises(ValueError, match=r"\[pages, K-1, D\] state"):
        gemv(x, w, conv=ConvStep(cw, None, state[:, :2], page, page))
    with pytest.raises(ValueError, match="activation must be silu"):
        gemv(x, w, conv=ConvStep(cw, None, state, page, page, activation="gelu"))


@pytest.mark.parametrize("impl", [gemv, gemv_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k,n,cfg", [
    (256, 40, None),
    (320, 21, {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}),  # a partial last step
    (2304, 24, {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1, "CHUNK": 16}),  # runs of 16
])
def test_gemv_applies_a_sigmoid_gate(impl, dtype, k, n, cfg):
    """An attention's output gate as the product's prologue: gemv(x, W, gate=z) against float64
    F.linear of x * sigmoid(z), the gate a view inside a wider row (NaN around it), output
    poisoned; and against the torch product it replaces, within the gate's one rounding."""
    from workers.ops import linear_op
    x = randn(1, k, dtype=dtype)
    wide = torch.full((1, k + 9), float("nan"), device=DEVICE, dtype=dtype)
    wide[:, 4:4 + k] = 3 * randn(1, k, dtype=dtype)
    z = wide[:, 4:4 + k]
    w = _nan_padded_rows(n, k, 24, dtype)
    ref = torch.nn.functional.linear(x.double() * torch.sigmoid(z.double()), w.double())
    if impl is gemv:
        out = torch.full((1, n), float("nan"), device=DEVICE, dtype=dtype)
        got = gemv(x, w, out=out, config=cfg, gate=z)
        assert got.data_ptr() == out.data_ptr()
        check(got, gemv(x * torch.sigmoid(z), w, config=cfg).float(), dtype)
    else:
        got = impl(x, w, gate=z)
    assert got.shape == ref.shape and got.dtype == dtype
    assert rel_err(got, ref) < 2 * TOL[dtype]
    # the layers' entry point: the gate in the GEMV at one row, first in torch at more rows
    two = torch.cat([x, x])
    check(linear_op(two, w.contiguous(), gate=torch.cat([z, z]))[1:], ref, dtype)
    with pytest.raises(ValueError, match="gate must be"):
        gemv(x, w, gate=z[:, :8])
    with pytest.raises(ValueError, match="not both"):
        gemv(x, w, gate=z, norm=GatedRMSNorm(z, randn(k, dtype=dtype), 64, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["silu", "gelu_tanh", "relu2"])
@pytest.mark.parametrize("k,n,cfg", [
    (256, 40, None),
    (320, 21, {"BLOCK_N": 4, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}),  # a partial last step
    (2304, 24, {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1, "CHUNK": 16}),  # runs of 16
])
def test_gemv_applies_an_activation(dtype, name, k, n, cfg):
    """An MLP's down projection with its activation as the prologue: gemv(gate | up, W, act=)
    against the activation's kernel followed by the product, and against float64; the input a view inside a wider row (NaN beyond it), output poisoned."""
    from kernels.activation import fusable
    from workers.ops import linear_op
    kernel, ref_act = {"silu": (silu_and_mul, silu_and_mul_ref), "gelu_tanh": (gelu_tanh_and_mul, gelu_tanh_and_mul_ref),
                       "relu2": (relu2, relu2_ref)}[name]
    code = fusable(kernel)
    width = 2 * k if code[1] else k
    wide = torch.full((1, width + 5), float("nan"), device=DEVICE, dtype=dtype)
    wide[:, :width] = 2 * randn(1, width, dtype=dtype)
    x = wide[:, :width]
    w = _nan_padded_rows(n, k, 24, dtype)
    out = torch.full((1, n), float("nan"), device=DEVICE, dtype=dtype)
    got = gemv(x, w, out=out, config=cfg, act=code)
    assert got.data_ptr() == out.data_ptr()
    # the same formula as the activation's kernel (bit for bit under the interpreter; on a GPU the
    # compiler may contract the two kernels' fp32 steps otherwise)
    assert rel_err(got, gemv(kernel(x), w, config=cfg)) < TOL[dtype] / 4
    ref = torch.nn.functional.linear(ref_act(x.double()), w.double())
    assert rel_err(got, ref) < 2 * TOL[dtype]
    assert rel_err(gemv_ref(x, w, act_and_mul=ref_act), ref) < 2 * TOL[dtype]
    # the layers' entry point: in the GEMV at one row, the activation's own launch at more rows
    from workers.ops import ACTIVATIONS, UNGATED_ACTIVATIONS
    op = {**ACTIVATIONS, **UNGATED_ACTIVATIONS}[name]
    check(linear_op(torch.cat([x, x]), w.contiguous(), act=op)[1:], ref, dtype)
    if code[1]:
        with pytest.raises(ValueError, match=r"\[1, 2K\]"):
            gemv(x[:, :k], w, act=code)
    with pytest.raises(ValueError, match="without a norm or a gate"):
        gemv(x, w, act=code, gate=x[:, :k] if code[1] else x)


def test_gemv_bad_arguments():
    x, w = randn(1, 8, dtype=torch.float32), randn(4, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="one row"):
        gemv(randn(2, 8, dtype=torch.float32), w)
    with pytest.raises(ValueError, match=r"weight must be \[N, 8\]"):
        gemv(x, randn(4, 9, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"bias must be \[4\]"):
        gemv(x, w, randn(5, dtype=torch.float32))
    with pytest.raises(TypeError, match="one dtype"):
        gemv(x, w.half())
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, out=torch.empty(1, 5, device=DEVICE))
    tile = {"BLOCK_N": 4, "BLOCK_K": 64, "num_warps": 4, "num_stages": 1}
    for chunk in (3, 128, 0):
        with pytest.raises(ValueError, match="CHUNK must be a power of two dividing BLOCK_K=64"):
            gemv(x, w, config={**tile, "CHUNK": chunk})


@pytest.mark.parametrize("impl", [gemv, gemv_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_gemv_widens_a_16_bit_row_against_an_fp32_weight(impl, dtype):
    """A router kept in fp32 (Nemotron-H's): a 16-bit x against an fp32 weight and bias gives
    fp32, against float64 F.linear of x as it is (its widening is exact), output poisoned; the
    skinny GEMM (more rows) still wants one dtype."""
    x, w, b = randn(1, 700, dtype=dtype), _nan_padded_rows(37, 700, 24, torch.float32), randn(37, dtype=torch.float32)
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
    if impl is gemv:
        out = torch.full((1, 37), float("nan"), device=DEVICE)
        assert gemv(x, w, b, out=out).data_ptr() == out.data_ptr()
        got = out
    else:
        got = impl(x, w, b)
    check(got, ref, torch.float32)
    with pytest.raises(TypeError, match="one dtype"):
        impl(x, w, b.to(dtype))
    with pytest.raises(TypeError, match="one dtype"):
        skinny_gemm(x.expand(2, -1), w)


def test_linear_op_routes_one_row_to_the_gemv():
    """The layers' entry point: the same numbers as F.linear for one row, a few and many (on a
    GPU one row goes through the GEMV, 2 to 32 through the skinny GEMM, elsewhere everything
    through F.linear)."""
    from workers.ops import linear_op
    w, b = randn(40, 72, dtype=torch.float32), randn(40, dtype=torch.float32)
    for rows in (1, 3, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1):
        x = randn(rows, 72, dtype=torch.float32)
        torch.testing.assert_close(linear_op(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
        # a 16-bit x against the fp32 weight: fp32, the product of x.float()
        half = x.to(torch.bfloat16)
        got = linear_op(half, w, b)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, torch.nn.functional.linear(half.float(), w, b), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- skinny GEMM (2-32 rows)

SWAPPED = {"BLOCK_N": 32, "BLOCK_K": 256, "SWAP": True, "num_warps": 4, "num_stages": 2}
STRAIGHT = {"BLOCK_N": 64, "BLOCK_K": 256, "SWAP": False, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("impl", [skinny_gemm, skinny_gemm_ref], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k,cfg", [
    (3, 37, 300, None),  # ragged N and K: masked columns and a partial last K step
    (16, 64, 512, None),  # whole tiles (the unmasked path), a full 16-row tile
    (17, 40, 256, SWAPPED),  # a 32-row tile with 15 padding rows
    (32, 50, 513, STRAIGHT),  # the product without the swap, ragged
    (2, 4100, 96, None),  # N past the first tile rule
])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_skinny_gemm(impl, dtype, m, n, k, cfg, bias):
    """Against float64 F.linear; the weight's and x's rows strided (views of wider matrices, the
    rest NaN), the output a row-strided view poisoned with NaN, its neighbours checked untouched."""
    x, w = _nan_padded_rows(m, k, 8, dtype), _nan_padded_rows(n, k, 24, dtype)
    b = randn(n, dtype=dtype) if bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    if impl is skinny_gemm_ref:
        check(impl(x, w, b), ref, dtype)
        return
    wide_out = torch.full((m, n + 5), float("nan"), device=DEVICE, dtype=dtype)
    out = wide_out[:, :n]
    got = skinny_gemm(x, w, b, out=out, config=cfg)
    assert got.data_ptr() == out.data_ptr()
    check(got, ref, dtype)
    assert torch.isnan(wide_out[:, n:]).all(), "wrote outside the output rows"


def test_skinny_config_fits_shared_memory():
    """The tile rule per shape, and its stages cut for fp32 weights (twice the bytes per stage)."""
    assert skinny_config(3840, 15360)["BLOCK_N"] == 32 and skinny_config(8192, 3840)["BLOCK_N"] == 64
    assert not skinny_config(30720, 3840)["SWAP"]
    for n in (3840, 8192, 30720):
        for elem, rows in ((2, 8), (2, 32), (4, 32)):
            cfg = skinny_config(n, 4096, elem, rows)
            block_m = 16 if rows <= 16 else 32
            assert (block_m + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * elem * cfg["num_stages"] <= 200 << 10
    assert skinny_config(3840, 4096, 4, 32)["num_stages"] < skinny_config(3840, 4096, 2, 8)["num_stages"]


def test_skinny_gemm_bad_arguments():
    w = randn(4, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="1 to 32 rows"):
        skinny_gemm(randn(SKINNY_MAX_ROWS + 1, 8, dtype=torch.float32), w)
    with pytest.raises(ValueError, match="1 to 32 rows"):
        skinny_gemm(randn(0, 8, dtype=torch.float32), w)
    with pytest.raises(ValueError, match="1 to 32 rows"):
        skinny_gemm_ref(randn(SKINNY_MAX_ROWS + 1, 8, dtype=torch.float32), w)
    with pytest.raises(ValueError, match=r"weight must be \[N, 8\]"):
        skinny_gemm(randn(3, 8, dtype=torch.float32), randn(4, 9, dtype=torch.float32))
    with pytest.raises(TypeError, match="one dtype"):
        skinny_gemm(randn(3, 8, dtype=torch.float32), w.half())
    with pytest.raises(ValueError, match="out must be"):
        skinny_gemm(randn(3, 8, dtype=torch.float32), w, out=torch.empty(3, 5, device=DEVICE))


# What kernels read before their PDL wait beyond `w_ptr` / `w_rows`: other weights and tables no
# kernel writes, and data a kernel at least two launches back wrote (kernels/pdl.py): a step's
# inputs (positions, slots), the DeltaNet update's pages and state, the experts' second GEMV's ids,
# a residual norm's residual stream.
EARLY_READS = {"_gdn_update_kernel": ("init_ptr", "write_ptr", "state_ptr", "alog_ptr", "dtb_ptr"),
               "_moe_gemv_kernel": ("ids_ptr",), "_moe_mxfp4_gemv_kernel": ("ids_ptr",),
               "_rms_norm_kernel": ("pre_w_ptr", "res_ptr"),
               "_rope_kernel": ("pos_ptr", "cache_ptr", "slot_ptr"),
               "_qk_norm_rope_kernel": ("pos_ptr", "cache_ptr", "slot_ptr")}


def test_every_pdl_kernel_waits_first_and_is_launched_with_pdl_args():
    """The rule of kernels/pdl.py, checked in the source: a kernel that takes `PDL` calls
    `pdl_wait(PDL)` before any other load or store (one before it would race with the kernel
    before), with two exceptions: before the wait (its last one, where a variant waits later) it
    may load from the weights (`w_ptr` / `w_rows`) and from what EARLY_READS names for it, and
    store nothing; every launch of it passes `**pdl_args(...)`."""
    import ast
    import pathlib
    folder = pathlib.Path(__file__).resolve().parent.parent / "kernels"
    kernels_with_pdl = 0
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = set()
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and "PDL" in [a.arg for a in fn.args.args] and fn.name != "pdl_wait":
                waits = [i for i, st in enumerate(fn.body)
                         if any(isinstance(c, ast.Call) and ast.unparse(c).startswith("pdl_wait(PDL") for c in ast.walk(st))]
                assert waits, f"{path.name}:{fn.name} never calls pdl_wait(PDL)"
                allowed = ("w_ptr", "w_rows", *EARLY_READS.get(fn.name, ()))
                for st in (st for i, st in enumerate(fn.body[:waits[-1]]) if i not in waits):
                    for call in ast.walk(st):
                        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
                            continue
                        what = f"{path.name}:{fn.name}: {ast.unparse(call)} before pdl_wait"
                        assert call.func.attr not in ("store", "atomic_add", "atomic_max", "atomic_cas"), what
                        if call.func.attr == "load":
                            assert ast.unparse(call.args[0]).startswith(allowed), what
                names.add(fn.name)
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript) and \
                    isinstance(call.func.value, ast.Name) and call.func.value.id in names:
                spread = [ast.unparse(k.value) for k in call.keywords if k.arg is None]
                assert any(s.startswith("pdl_args(") for s in spread), f"{path.name}: {call.func.value.id} launch"
                kernels_with_pdl += 1
    assert kernels_with_pdl >= 12


def test_pdl_is_off_the_gpu_and_its_switch_is_checked():
    import os
    import subprocess
    import sys

    from kernels.pdl import pdl_args
    assert pdl_args(torch.empty(2)) == {"PDL": False}
    env = {**os.environ, "DISTENGINE_PDL": "on"}
    proc = subprocess.run([sys.executable, "-c", "import kernels.pdl"], env=env, capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), check=False)
    assert proc.returncode != 0 and "DISTENGINE_PDL must be 0 or 1, got 'on'" in proc.stderr
