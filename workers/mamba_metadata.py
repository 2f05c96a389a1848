"""Which state pages the Mamba layers of a step read and write, from the block tables.

The rule (the KV cache manager's MambaManager allocates for it): a step computing tokens [T, N)
of a sequence reads the state from its table entry (T-1)//B (a zero state when T = 0), writes
the state after token N-1 to entry (N-1)//B, and writes the state at the end of every block that
ends inside the step to that block's entry when the entry is not null (a checkpoint the manager
kept for prefix caching). A page id <= 0 is "none" to the kernels: read as zeros, never written.

For a prefill the host cuts the step's tokens into scan chunks: at each sequence's end, at every
block end where a checkpoint is written (given `holds_state`, the block ends whose entry holds a
page in some Mamba group; without it, every block end) and every `max_chunk` tokens from the last
cut; the chunk ending at a block end or at the sequence's end carries the table entry whose page
receives the state there. Cutting only where a state is kept matters when the block size is no
multiple of the chunk: Qwen3.6-27B's 208-token blocks would cut an 8,192-token prompt into 158
chunks (64, 64, 64, 16 a block) where 128 and the kept checkpoints do; each is a step of the scans'
chains.
All Mamba groups see the same tokens, so the chunks are computed once and only the page ids
differ per group: one gather from the tables per step gives them all.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# (sequence index [k], table entry [k]) -> page ids [Mamba groups, k]; entry -1 -> 0.
PageLookup = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class MambaMetadata:
    """One step's state pages for every Mamba group (row j of each tensor: Mamba group j)."""

    init_pages: torch.Tensor  # [G, S] int32: the state each sequence starts from
    # Decode steps (one token per sequence): the page each sequence's new state goes to.
    write_pages: torch.Tensor | None = None  # [G, S] int32
    # Prefill steps: the scan chunks (see the module docstring).
    chunk_start: torch.Tensor | None = None  # [NC + 1] int32, token offsets
    chunk_seq: torch.Tensor | None = None  # [NC] int32
    chunk_pages: torch.Tensor | None = None  # [G, NC] int32: where the state after the chunk goes

    @property
    def decode(self) -> bool:
        return self.write_pages is not None


def plan_chunks(num_computed: np.ndarray, qlens: np.ndarray, block_size: int, max_chunk: int,
                holds_state: Callable[[int, int], bool] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chunk_start [NC+1], chunk_seq [NC], chunk_entry [NC]) of a prefill step on the host;
    chunk_entry is the table entry written after the chunk, -1 for none. `holds_state(s, entry)`:
    whether sequence s's table entry holds a page in some Mamba group (None: cut at every block
    end)."""
    starts: list[int] = [0]
    seqs: list[int] = []
    entries: list[int] = []
    t = 0
    for s, (c, n) in enumerate(zip(num_computed.tolist(), qlens.tolist())):
        end = c + n
        pos = c
        while pos < end:
            stop = min(end, pos + max_chunk)
            block_end = (pos // block_size + 1) * block_size
            while block_end < stop:
                if holds_state is None or holds_state(s, block_end // block_size - 1):
                    stop = block_end
                    break
                block_end += block_size
            if stop == end:
                entry = (end - 1) // block_size
            elif stop % block_size == 0:
                entry = stop // block_size - 1
            else:
                entry = -1
            t += stop - pos
            starts.append(t)
            seqs.append(s)
            entries.append(entry)
            pos = stop
    return (np.asarray(starts, dtype=np.int32), np.asarray(seqs, dtype=np.int32),
            np.asarray(entries, dtype=np.int32))


def init_entries(num_computed: torch.Tensor, block_size: int) -> torch.Tensor:
    """Entry each sequence reads its state from (-1: none, a zero state)."""
    return torch.where(num_computed > 0, (num_computed - 1) // block_size, -1)


def decode_metadata(lookup: PageLookup, num_computed: torch.Tensor, block_size: int) -> MambaMetadata:
    """One token per sequence: everything from the device (what a CUDA graph captures)."""
    seqs = torch.arange(num_computed.shape[0], device=num_computed.device)
    return MambaMetadata(init_pages=lookup(seqs, init_entries(num_computed, block_size)),
                         write_pages=lookup(seqs, num_computed // block_size))


def prefill_metadata(lookup: PageLookup, num_computed: torch.Tensor, block_size: int, chunk_start: torch.Tensor,
                     chunk_seq: torch.Tensor, chunk_entry: torch.Tensor) -> MambaMetadata:
    """From the step's chunks (`plan_chunks`, already on the device)."""
    seqs = torch.arange(num_computed.shape[0], device=num_computed.device)
    return MambaMetadata(init_pages=lookup(seqs, init_entries(num_computed, block_size)),
                         chunk_start=chunk_start, chunk_seq=chunk_seq,
                         chunk_pages=lookup(chunk_seq.long(), chunk_entry))


def table_lookup(tables: torch.Tensor, groups: torch.Tensor, rows: torch.Tensor) -> PageLookup:
    """A lookup into `tables[group, row, entry]` for the given Mamba groups and the step's rows."""
    def lookup(seqs: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        e = entries.long()
        pages = tables[groups[:, None], rows[seqs.long()][None, :], e.clamp_min(0)[None, :]]
        return torch.where(e[None, :] >= 0, pages, 0).to(torch.int32)
    return lookup
