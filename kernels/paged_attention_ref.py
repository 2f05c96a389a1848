"""Plain-torch paged attention: the oracle for the Triton kernel and what the engine runs on CPU.

Same arguments and semantics as `kernels.paged_attention.paged_attention`. Per sequence it
gathers only the key positions its queries read (from the window's or chunk's start), so like
the kernel it never touches the null block or blocks that left the window. An fp8 cache's
elements are read as e4m3 x their scale (`k_scale`, `v_scale`).
"""
from __future__ import annotations

import torch

from kernels.kv_store import check_scales, is_fp8, value_group, values_view


def paged_attention_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor, max_query_len: int = 0, max_seq_len: int = 0, scale: float = 1.0,
    sliding_window: int = 0, chunk_size: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None,
    head_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, **_unused,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    gqa = num_q_heads // num_kv_heads
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q) if out is None else out
    check_scales(kv_cache, k_scale, v_scale)
    ks, vs = (k_scale.to(compute), v_scale.to(compute)) if is_fp8(kv_cache) else (1.0, 1.0)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        context = seq_len - q_len
        lo = 0
        if sliding_window:
            lo = max(0, context - sliding_window + 1)
        if chunk_size:
            lo = context // chunk_size * chunk_size
        kpos = torch.arange(lo, seq_len, device=q.device)
        blocks = block_table[s, kpos // block_size].long()
        slots = kpos % block_size
        k = _gather(kv_cache, blocks, 0, slots).to(compute) * ks  # [n, Hkv, D]
        v = _gather(kv_cache, blocks, 1, slots).to(compute) * vs
        qs = q[q0:q1].to(compute).reshape(q_len, num_kv_heads, gqa, head_dim)
        scores = torch.einsum("qhgd,nhd->hgqn", qs, k) * scale
        if head_scale is not None:
            scores = scores * head_scale.to(compute).view(num_kv_heads, gqa, 1, 1)
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(context, seq_len, device=q.device)
        visible = kpos[None, :] <= qpos[:, None]
        if sliding_window:
            visible &= kpos[None, :] > qpos[:, None] - sliding_window
        if chunk_size:
            visible &= kpos[None, :] >= qpos[:, None] // chunk_size * chunk_size
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.to(compute).view(num_kv_heads, gqa, 1, 1).expand(-1, -1, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hgqn,nhd->qhgd", probs, v)
        out[q0:q1] = o.reshape(q_len, num_q_heads, head_dim).to(out.dtype)
    return out


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor, kv: int, slots: torch.Tensor) -> torch.Tensor:
    """K (kv=0) or V of the given positions; an fp8 cache's as bytes (not every torch build
    indexes float8 tensors), then read back as e4m3, its values from their groups."""
    if not is_fp8(kv_cache):
        return kv_cache[blocks, kv, slots]
    if kv == 0:
        return kv_cache.view(torch.uint8)[blocks, 0, slots].view(kv_cache.dtype)
    g = value_group(kv_cache)
    return values_view(kv_cache)[blocks, slots // g, :, :, slots % g].view(kv_cache.dtype)
