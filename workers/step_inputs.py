"""Flattening one step's sequences into the model's inputs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.layers.attention import AttentionMetadata


@dataclass
class SeqStep:
    """One sequence's share of a step: its new tokens after `num_computed` cached ones, and its
    block table in every KV cache group (as the manager holds it; null = 0)."""

    token_ids: list[int]
    num_computed: int
    block_ids: list[list[int]]
    needs_logits: bool = True


def prepare_inputs(seqs: list[SeqStep], block_size: int, device: torch.device):
    """(input_ids, positions, AttentionMetadata, logits_indices) for a batch of sequences:
    prefills, prefix-continuing chunks and decodes together."""
    ids, pos, starts, lens, logits_idx = [], [], [0], [], []
    num_groups = len(seqs[0].block_ids) if seqs else 0
    slots: list[list[int]] = [[] for _ in range(num_groups)]
    for s in seqs:
        n = len(s.token_ids)
        p = list(range(s.num_computed, s.num_computed + n))
        ids += s.token_ids
        pos += p
        starts.append(starts[-1] + n)
        lens.append(s.num_computed + n)
        if s.needs_logits:
            logits_idx.append(starts[-1] - 1)
        for g, table in enumerate(s.block_ids):
            for q in p:
                b = table[q // block_size]
                # A null entry never takes a write; the manager never schedules one there.
                slots[g].append(b * block_size + q % block_size if b else -1)
    width = [max((len(s.block_ids[g]) for s in seqs), default=0) or 1 for g in range(num_groups)]
    tables = [torch.tensor([s.block_ids[g] + [0] * (width[g] - len(s.block_ids[g])) for s in seqs],
                           dtype=torch.int32, device=device) for g in range(num_groups)]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        max_query_len=max(len(s.token_ids) for s in seqs), max_seq_len=max(lens),
        slot_mappings=[torch.tensor(x, dtype=torch.int64, device=device) for x in slots],
        block_tables=tables)
    return (torch.tensor(ids, dtype=torch.int64, device=device), torch.tensor(pos, dtype=torch.int64, device=device),
            meta, torch.tensor(logits_idx, dtype=torch.int64, device=device))
