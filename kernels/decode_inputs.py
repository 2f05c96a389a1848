"""A decode step's model inputs from the persistent batch's device state, in one launch.

A decode step in a CUDA graph derives its inputs on the device from a fixed region (each
sequence's row and position) and the batch's state (last sampled tokens, block tables). Through
torch that was ~30 launches of one program each at the head of every step (index, divide,
compare, where, casts), about 75 us of a Qwen3.6-35B-A3B batch-1 step on one H200; here it is
one launch of a program per sequence.

What it computes, sequence s of row r = rows[s] at position p = positions[s] (the engine's torch
path computes the same: `workers.block_tables.BlockTables.slot_mapping` / `of_rows`,
`workers.mamba_metadata.decode_metadata`):
- input_ids[s] = last_token[r]; positions[s] = p (int64);
- per KV cache group g: slot_mappings[g, s] = b * B + p % B for the block b = tables[g, r, p // B],
  -1 where b is the null block (0); block_tables[g, s, :] = tables[g, r, :];
- per Mamba group j (a group id m_j): init_pages[j, s] = tables[m_j, r, (p - 1) // B] when p > 0,
  else 0 (a zero state); write_pages[j, s] = tables[m_j, r, p // B].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = ["DecodeInputs", "decode_inputs"]


@dataclass
class DecodeInputs:
    input_ids: torch.Tensor             # [S] last_token's dtype
    positions: torch.Tensor             # [S] int64
    slot_mappings: torch.Tensor         # [G, S] int64
    block_tables: torch.Tensor          # [G, S, W] int32
    init_pages: torch.Tensor | None     # [M, S] int32 (None without Mamba groups)
    write_pages: torch.Tensor | None


@triton.jit
def _decode_inputs_kernel(rows_ptr, pos_ptr, last_ptr, tables_ptr, mamba_ptr, ids_ptr, pos_out_ptr, slot_ptr,
                          bt_ptr, init_ptr, write_ptr, S, G, M, R, W, B,
                          BLOCK_W: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr):
    s = tl.program_id(0)
    r = tl.load(rows_ptr + s).to(tl.int64)
    p = tl.load(pos_ptr + s).to(tl.int64)
    tl.store(ids_ptr + s, tl.load(last_ptr + r))
    tl.store(pos_out_ptr + s, p)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    row_base = (g.to(tl.int64) * R + r) * W  # tables[g, r, 0]
    b = tl.load(tables_ptr + row_base + p // B, mask=g_ok, other=0).to(tl.int64)
    tl.store(slot_ptr + g * S + s, tl.where(b > 0, b * B + p % B, -1), mask=g_ok)
    w = tl.arange(0, BLOCK_W)
    for w0 in range(0, W, BLOCK_W):
        ok = g_ok[:, None] & (w0 + w < W)[None, :]
        entries = tl.load(tables_ptr + row_base[:, None] + w0 + w[None, :], mask=ok)
        tl.store(bt_ptr + (g.to(tl.int64)[:, None] * S + s) * W + w0 + w[None, :], entries, mask=ok)
    if BLOCK_M > 0:
        j = tl.arange(0, BLOCK_M)
        j_ok = j < M
        m_base = (tl.load(mamba_ptr + j, mask=j_ok, other=0).to(tl.int64) * R + r) * W
        init_entry = tl.where(p > 0, (p - 1) // B, 0)
        started = (tl.zeros([BLOCK_M], tl.int64) + p) > 0  # (the interpreter rejects mask & scalar)
        init = tl.load(tables_ptr + m_base + init_entry, mask=j_ok & started, other=0)
        tl.store(init_ptr + j * S + s, init, mask=j_ok)
        tl.store(write_ptr + j * S + s, tl.load(tables_ptr + m_base + p // B, mask=j_ok, other=0), mask=j_ok)


def decode_inputs(rows: torch.Tensor, positions: torch.Tensor, last_token: torch.Tensor, tables: torch.Tensor,
                  mamba_groups: torch.Tensor | None, block_size: int) -> DecodeInputs:
    """rows, positions [S] int32 (a position is the sequence's computed tokens, < W * block_size);
    last_token [R] (any integer dtype); tables [G, R, W] int32, contiguous; mamba_groups [M] (group
    ids into tables) or None."""
    if rows.dim() != 1 or positions.shape != rows.shape or rows.dtype != torch.int32 or positions.dtype != torch.int32:
        raise ValueError(f"rows and positions must be [S] int32, got {tuple(rows.shape)} {rows.dtype} and "
                         f"{tuple(positions.shape)} {positions.dtype}")
    if tables.dim() != 3 or tables.dtype != torch.int32 or not tables.is_contiguous():
        raise ValueError(f"tables must be a contiguous [G, R, W] int32 tensor, got {tuple(tables.shape)} {tables.dtype}")
    if last_token.dim() != 1 or last_token.shape[0] != tables.shape[1]:
        raise ValueError(f"last_token must be [R={tables.shape[1]}], got {tuple(last_token.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    S = rows.shape[0]
    G, R, W = tables.shape
    M = 0 if mamba_groups is None else mamba_groups.shape[0]
    dev = rows.device
    out = DecodeInputs(torch.empty(S, dtype=last_token.dtype, device=dev), torch.empty(S, dtype=torch.int64, device=dev),
                       torch.empty(G, S, dtype=torch.int64, device=dev), torch.empty(G, S, W, dtype=torch.int32, device=dev),
                       torch.empty(M, S, dtype=torch.int32, device=dev) if M else None,
                       torch.empty(M, S, dtype=torch.int32, device=dev) if M else None)
    if S == 0:
        return out
    mamba = mamba_groups if M else tables
    _decode_inputs_kernel[(S,)](rows, positions, last_token, tables, mamba, out.input_ids, out.positions,
                                out.slot_mappings, out.block_tables, out.init_pages if M else tables,
                                out.write_pages if M else tables, S, G, M, R, W, block_size,
                                BLOCK_W=min(1024, triton.next_power_of_2(W)), BLOCK_G=triton.next_power_of_2(G),
                                BLOCK_M=triton.next_power_of_2(M) if M else 0, num_warps=4)
    return out
