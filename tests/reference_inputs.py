"""A plain flattening of one step's sequences into the model's inputs, token by token from each
sequence's whole block table: the reference the persistent batch's inputs are checked against."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.mamba_ssd import SSD_MAX_CHUNK
from workers.layers.attention import AttentionMetadata
from workers.mamba_metadata import MambaMetadata, decode_metadata, plan_chunks, prefill_metadata


@dataclass
class SeqStep:
    """One sequence's share of a step: its new tokens after `num_computed` cached ones, and its
    block table in every KV cache group (as the manager holds it; null = 0)."""

    token_ids: list[int]
    num_computed: int
    block_ids: list[list[int]]
    needs_logits: bool = True


def prepare_inputs(seqs: list[SeqStep], block_size: int, device: torch.device, mamba_groups: list[int] = ()):
    """(input_ids, positions, AttentionMetadata, logits_indices) for a batch of sequences:
    prefills, prefix-continuing chunks and decodes together. Slot mappings are gathered from the
    padded block tables in one tensor operation per group, not token by token. `mamba_groups`:
    the plan's Mamba groups, whose state pages the metadata then carries."""
    lens_q = [len(s.token_ids) for s in seqs]
    starts = [0]
    for n in lens_q:
        starts.append(starts[-1] + n)
    seq_lens = [s.num_computed + n for s, n in zip(seqs, lens_q)]
    logits_idx = [starts[i + 1] - 1 for i, s in enumerate(seqs) if s.needs_logits]
    ids = [t for s in seqs for t in s.token_ids]
    seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lens_q, dtype=torch.int64))
    pos = torch.arange(starts[-1], dtype=torch.int64) - torch.tensor(starts[:-1], dtype=torch.int64)[seq_of_token] \
        + torch.tensor([s.num_computed for s in seqs], dtype=torch.int64)[seq_of_token]
    num_groups = len(seqs[0].block_ids) if seqs else 0
    tables, slots = [], []
    for g in range(num_groups):
        width = max(len(s.block_ids[g]) for s in seqs) or 1
        table = torch.tensor([s.block_ids[g] + [0] * (width - len(s.block_ids[g])) for s in seqs], dtype=torch.int64)
        block = table[seq_of_token, pos // block_size]
        # A null entry never takes a write; the manager never schedules one there.
        slots.append(torch.where(block > 0, block * block_size + pos % block_size, -1).to(device))
        tables.append(table.to(torch.int32).to(device))
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        max_query_len=max(lens_q), max_seq_len=max(seq_lens), slot_mappings=slots, block_tables=tables,
        prompt_lens=tuple(lens_q) if seqs and not any(s.num_computed for s in seqs) else None,
        mamba=_mamba(seqs, lens_q, [tables[g] for g in mamba_groups], block_size, device) if mamba_groups else None)
    return (torch.tensor(ids, dtype=torch.int64, device=device), pos.to(device), meta,
            torch.tensor(logits_idx, dtype=torch.int64, device=device))


def _mamba(seqs: list[SeqStep], lens_q: list[int], tables: list[torch.Tensor], block_size: int,
           device: torch.device) -> MambaMetadata:
    width = max(t.shape[1] for t in tables)
    stacked = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tables])

    def lookup(s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        e = e.long()
        return torch.where(e >= 0, stacked[:, s.long(), e.clamp_min(0)], 0).to(torch.int32)

    computed = np.asarray([s.num_computed for s in seqs], dtype=np.int64)
    computed_dev = torch.from_numpy(computed).to(device)
    if max(lens_q) == 1:
        return decode_metadata(lookup, computed_dev, block_size)
    kept = (stacked.cpu() > 0).any(dim=0)  # [S, entries]: a state page in some Mamba group
    start, seq, entry = (torch.from_numpy(a).to(device) for a in
                         plan_chunks(computed, np.asarray(lens_q, dtype=np.int64), block_size, SSD_MAX_CHUNK,
                                     lambda s, e: bool(kept[s, e])))
    return prefill_metadata(lookup, computed_dev, block_size, start, seq, entry)
