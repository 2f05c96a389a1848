"""Whole prompts attending on their own K/V (`workers.ops.prompt_attention_op`, cuDNN on a GPU)
against the paged path, and the attention layer's choice between the two."""
from __future__ import annotations

import pytest
import torch

from kernels.paged_attention_ref import paged_attention_ref
from workers.layers import attention as attention_mod
from workers.layers.attention import PROMPT_ROUTE_MAX_SEQS, Attention, AttentionMetadata
from workers.ops import paged_attention_op, prompt_attention_op

BLOCK = 8


def _qkv(T: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str, seed: int):
    """q, k, v as views of one fused projection output (the layer's layout)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, generator=g).to(device=device, dtype=dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(T, hq, d), k.view(T, hkv, d), v.view(T, hkv, d)


def _paged(prompt_lens, hkv: int, d: int, dtype: torch.dtype, device: str, fp8: bool = False):
    """A cache of enough blocks (shuffled, block 0 the null one), the prompts' tables, slots and
    metadata."""
    per = [-(-n // BLOCK) for n in prompt_lens]
    blocks = torch.randperm(sum(per), generator=torch.Generator().manual_seed(1)) + 1
    width = max(per)
    table = torch.zeros(len(prompt_lens), width, dtype=torch.int32)
    slots, at = [], 0
    for s, (n, p) in enumerate(zip(prompt_lens, per)):
        table[s, :p] = blocks[at:at + p].to(torch.int32)
        at += p
        pos = torch.arange(n)
        slots.append(table[s, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    cache = torch.zeros(sum(per) + 1, 2, BLOCK, hkv, d, dtype=cache_dtype, device=device)
    qsl = torch.tensor([0] + prompt_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(query_start_loc=qsl.to(device), seq_lens=torch.tensor(prompt_lens, dtype=torch.int32,
                                                                                     device=device),
                             max_query_len=max(prompt_lens), max_seq_len=max(prompt_lens),
                             slot_mappings=[torch.cat(slots).to(device)], block_tables=[table.to(device)],
                             prompt_lens=tuple(prompt_lens))
    return cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)], ids=["mha", "gqa3"])
def test_prompt_attention_matches_the_paged_reference(dtype, heads):
    hq, hkv = heads
    d, lens = 16, [5, 1, 19, 2]
    q, k, v = _qkv(sum(lens), hq, hkv, d, dtype, "cpu", 0)
    cache, meta = _paged(lens, hkv, d, dtype, "cpu")
    cache[meta.block_tables[0].long().flatten()] = 0  # (only the stored slots are read)
    from kernels.kv_store import store_kv_ref
    store_kv_ref(k, v, cache, meta.slot_mappings[0])
    ref = paged_attention_ref(q, cache, meta.block_tables[0], meta.query_start_loc, meta.seq_lens, scale=d ** -0.5)
    got = prompt_attention_op(q, k, v, meta.prompt_lens, d ** -0.5)
    assert got.shape == q.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref.float()).abs().max() < tol


def _layer(hq: int, hkv: int, d: int, cache: torch.Tensor, **kw) -> Attention:
    layer = Attention(hq, hkv, d, d ** -0.5, "model.layers.0", **kw)
    layer.bind_kv_cache(cache, 0)
    return layer


@pytest.fixture
def spy(monkeypatch):
    """The route made available on CPU, its calls counted."""
    calls = []

    def counted(*a, **k):
        calls.append(a[3])
        return prompt_attention_op(*a, **k)
    monkeypatch.setattr(attention_mod, "cudnn_attention_available", lambda device: True)
    monkeypatch.setattr(attention_mod, "prompt_attention_op", counted)
    return calls


@pytest.mark.parametrize("stored", [False, True])
def test_layer_takes_the_route_for_whole_prompts(spy, stored):
    hq, hkv, d, lens = 4, 2, 16, [7, 12]
    q, k, v = _qkv(sum(lens), hq, hkv, d, torch.bfloat16, "cpu", 2)
    cache, meta = _paged(lens, hkv, d, torch.bfloat16, "cpu")
    layer = _layer(hq, hkv, d, cache)
    if stored:
        from kernels.kv_store import store_kv_ref
        store_kv_ref(k, v, cache, meta.slot_mappings[0])
    out = layer(q.reshape(len(q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), meta, stored=stored)
    assert spy == [meta.prompt_lens]
    # the cache holds the step's K/V either way, and the paged path over it gives the same outputs
    ref = paged_attention_op(q, cache, meta.block_tables[0], meta.query_start_loc, meta.seq_lens, meta.max_query_len,
                             meta.max_seq_len, d ** -0.5)
    assert out.shape == (len(q), hq * d)
    assert (out.float() - ref.reshape(len(q), -1).float()).abs().max() < 2e-2


@pytest.mark.parametrize("case", ["context", "too_many", "window", "softcap", "fp8", "no_kv", "fp32"])
def test_layer_keeps_the_paged_kernel_otherwise(spy, case):
    hq, hkv, d = 4, 2, 16
    lens = [3] * (PROMPT_ROUTE_MAX_SEQS + 1) if case == "too_many" else [7, 12]
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    q, k, v = _qkv(sum(lens), hq, hkv, d, dtype, "cpu", 3)
    cache, meta = _paged(lens, hkv, d, dtype, "cpu", fp8=case == "fp8")
    kw = {"sliding_window": 4} if case == "window" else {"softcap": 30.0} if case == "softcap" else {}
    layer = _layer(hq, hkv, d, cache, **kw)
    if case == "context":  # a prefix-continuing step: keys before this step's
        meta.prompt_lens = None
    if case == "no_kv":  # a layer reading another layer's K/V
        from kernels.kv_store import store_kv_ref
        store_kv_ref(k, v, cache, meta.slot_mappings[0])
        k = v = None
    out = layer(q.reshape(len(q), -1), k, v, meta)
    assert spy == [] and out.shape == (len(q), hq * d) and torch.isfinite(out.float()).all()


def test_layer_falls_back_when_cudnn_declines(monkeypatch):
    hq, hkv, d, lens = 4, 2, 16, [9]
    q, k, v = _qkv(9, hq, hkv, d, torch.bfloat16, "cpu", 4)
    cache, meta = _paged(lens, hkv, d, torch.bfloat16, "cpu")
    layer = _layer(hq, hkv, d, cache)
    monkeypatch.setattr(attention_mod, "cudnn_attention_available", lambda device: True)

    def declines(*a, **k):
        raise RuntimeError("No available kernel. Aborting execution.")
    monkeypatch.setattr(attention_mod, "prompt_attention_op", declines)
    out = layer(q.reshape(9, -1), k.reshape(9, -1), v.reshape(9, -1), meta)
    ref = paged_attention_op(q, cache, meta.block_tables[0], meta.query_start_loc, meta.seq_lens, 9, 9, d ** -0.5)
    assert torch.equal(out, ref.reshape(9, -1)) and layer.prompt_declined == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads", [(24, 4, 256), (16, 2, 256), (32, 8, 128)], ids=["qwen3.6-27b", "qwen3.6-35b", "d128"])
def test_cudnn_route_against_the_paged_kernel_on_a_gpu(heads):
    """cuDNN runs every published shape the route takes (GQA through strided views, heads of 128
    and 256), in place of the paged kernel, to bf16 rounding."""
    from workers.ops import cudnn_attention_available
    if not cudnn_attention_available(torch.device("cuda")):
        pytest.skip("cuDNN attention needs a Hopper or newer GPU")
    hq, hkv, d = heads
    lens = [300, 1, 77, 2, 1024]
    q, k, v = _qkv(sum(lens), hq, hkv, d, torch.bfloat16, "cuda", 5)
    cache, meta = _paged(lens, hkv, d, torch.bfloat16, "cuda")
    layer = _layer(hq, hkv, d, cache)
    assert layer.takes_prompt_route(q, meta)
    out = layer(q.reshape(len(q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1), meta)
    assert layer.prompt_declined == 0, "cuDNN declined"
    ref = paged_attention_op(q, cache, meta.block_tables[0], meta.query_start_loc, meta.seq_lens, meta.max_query_len,
                             meta.max_seq_len, d ** -0.5)
    ref64 = paged_attention_ref(q.double(), cache.double(), meta.block_tables[0], meta.query_start_loc, meta.seq_lens,
                                scale=d ** -0.5)
    err = (out.double() - ref64.reshape(len(q), -1)).abs().max().item()
    err_paged = (ref.double() - ref64).abs().max().item()
    assert err <= 2 * err_paged + 1e-3, (err, err_paged)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["qwen3_5", "llama"])
def test_engine_prefills_through_cudnn_as_through_the_paged_kernel(arch, tmp_path, monkeypatch):
    """bf16, TP=1 in this process: a batch of whole prompts takes the route (the keys stored by
    the rotary launch, given to the layer), and its prompt logprobs and first tokens are those of
    the same engine with the route off, to bf16 rounding."""
    from distengine import LLM, SamplingParams
    from tests.test_models import build
    from workers.ops import cudnn_attention_available
    if not cudnn_attention_available(torch.device("cuda")):
        pytest.skip("cuDNN attention needs a Hopper or newer GPU")
    hf, _ = build(arch)
    hf.save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, 300, (n,), generator=g).tolist()} for n in (40, 7, 1, 90)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, logprobs=2)
    calls, declined = [], []

    def run(route: bool):
        def counted(*a, **k):
            calls.append(a[3])
            try:
                return prompt_attention_op(*a, **k)
            except RuntimeError as e:
                declined.append(repr(e))
                raise
        monkeypatch.setattr(attention_mod, "prompt_attention_op", counted)
        monkeypatch.setattr(attention_mod, "cudnn_attention_available", lambda d: route)
        llm = LLM(str(tmp_path), device="cuda", dtype="bfloat16", distributed_executor_backend="uni",
                  max_model_len=256, gpu_memory_utilization=0.2, enforce_eager=True)
        try:
            return llm.generate(prompts, params)
        finally:
            llm.shutdown()
    on = run(True)
    assert calls and not declined, declined[:1] or "the route was not taken"
    taken = len(calls)
    off = run(False)
    assert len(calls) == taken
    for a, b in zip(on, off):
        lp_a = [next(iter(d.values())) for d in a.prompt_logprobs[1:]]
        lp_b = [next(iter(d.values())) for d in b.prompt_logprobs[1:]]
        assert all(abs(x - y) < 0.05 for x, y in zip(lp_a, lp_b))
        top2 = sorted(b.outputs[0].logprobs[0].values(), reverse=True)[:2]
        if top2[0] - top2[1] > 0.05:  # not a near-tie at bf16 rounding
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
