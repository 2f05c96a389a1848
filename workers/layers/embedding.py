"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the
(padded) vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.parallel import TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype, device: torch.device,
                 name: str = "") -> None:
        super().__init__()
        self.tp, self.name, self.vocab_size, self.hidden = tp, name, vocab_size, hidden
        self.per_rank = -(-vocab_size // tp.world_size)  # the last rank's slice is padded
        self.start = tp.rank * self.per_rank
        self.end = min(vocab_size, self.start + self.per_rank)
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden, dtype=dtype, device=device), requires_grad=False)

    def full_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"weight": (self.vocab_size, self.hidden)}

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard: str | None = None) -> None:
        if tuple(full.shape) != (self.vocab_size, self.hidden):
            raise ValueError(f"{self.name}: checkpoint tensor has shape {tuple(full.shape)}, "
                             f"expected {(self.vocab_size, self.hidden)}")
        param.data[: self.end - self.start].copy_(full[self.start:self.end])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.end - self.start)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = h W^T over this rank's vocabulary slice, gathered to the full vocabulary."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        if self.tp.world_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]
