"""Every KV cache group's block table, one row per request of the persistent batch, on the device.

A row's whole table goes down once, when its request enters the batch; after that a step sends
only the block ids appended to it. Both are queued here and staged with the step's inputs.

The invariant of the tables (the manager's, kept here): entry i of a row's table in a group covers
tokens [i*B, (i+1)*B). Entries the manager replaced by the null block (blocks that left a sliding
window or a past local chunk) are never resent, so here they keep their old block id; no kernel
reads them, because a step reads only the entries from `first_needed_block(num_computed)` up to
the end of its tokens, and those are never null. `check` asserts exactly that (`debug_checks`).

Row `max_num_seqs` is the padding row: all-null tables, never assigned. Padded slots of a CUDA
graph's batch point at it, so they read and write nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from distengine.kv_cache.plan import KVCachePlan
from distengine.model_config import MAMBA
from workers.mamba_metadata import PageLookup, table_lookup
from workers.staging import ALIGN, Section, Staging, round_up


@dataclass
class StagedAppends:
    """The table entries a step writes: flat indices into the tables, and their block ids."""
    index: Section
    blocks: Section


class BlockTables:
    def __init__(self, plan: KVCachePlan, max_num_seqs: int, device: torch.device, debug: bool = False) -> None:
        self.plan = plan
        self.block_size = plan.block_size
        self.num_groups = len(plan.groups)
        self.num_rows = max_num_seqs + 1  # the last one pads graph batches
        # Every position up to max_model_len; rounded up to 16 bytes per row.
        self.width = round_up(-(-plan.max_model_len // self.block_size), ALIGN)
        self.tables = torch.zeros(self.num_groups, self.num_rows, self.width, dtype=torch.int32, device=device)
        self.num_entries = np.zeros((self.num_groups, self.num_rows), dtype=np.int64)
        self.host = np.zeros(self.tables.shape, dtype=np.int32) if debug else None
        self._index: list[np.ndarray] = []
        self._blocks: list[list[int]] = []
        self._first_needed = [g.spec.first_needed_block for g in plan.groups]
        mamba = plan.mamba_group_ids
        self.mamba_groups = torch.tensor(mamba, dtype=torch.int64, device=device) if mamba else None
        # The Mamba groups' entries on the host too: a prefill's scan chunks end only where a
        # state is kept (`holds_state`, `workers.mamba_metadata.plan_chunks`).
        self._mamba_of = {g: i for i, g in enumerate(mamba)}
        self._mamba_host = np.zeros((len(mamba), self.num_rows, self.width), dtype=np.int32) if mamba else None

    # ---- what changed ------------------------------------------------------------------------
    def set_row(self, req_id: str, row: int, block_ids: list[list[int]]) -> None:
        """A request's whole table, from entry 0 (what a reused row holds beyond it is never read)."""
        if len(block_ids) != self.num_groups:
            raise ValueError(f"request {req_id}: {len(block_ids)} block tables for {self.num_groups} groups")
        if any(len(t) > self.width for t in block_ids):
            raise ValueError(f"request {req_id}: a block table longer than max_model_len allows")
        for g, ids in enumerate(block_ids):
            if ids:
                self._queue(g, row, 0, ids)
            self.num_entries[g, row] = len(ids)

    def append(self, req_id: str, row: int, new_block_ids: list[list[int]]) -> None:
        if len(new_block_ids) != self.num_groups:
            raise ValueError(f"request {req_id}: appends for {len(new_block_ids)} groups, not {self.num_groups}")
        for g, ids in enumerate(new_block_ids):
            if ids:
                start = int(self.num_entries[g, row])
                if start + len(ids) > self.width:
                    raise ValueError(f"request {req_id}: its table would outgrow max_model_len")
                self._queue(g, row, start, ids)
                self.num_entries[g, row] = start + len(ids)

    def _queue(self, group: int, row: int, start: int, ids: list[int]) -> None:
        self._index.append(np.arange(start, start + len(ids)) + (group * self.num_rows + row) * self.width)
        self._blocks.append(ids)
        if group in self._mamba_of:
            self._mamba_host[self._mamba_of[group], row, start:start + len(ids)] = ids

    def holds_state(self, row: int, entry: int) -> bool:
        """Whether table entry `entry` of `row` holds a state page in some Mamba group."""
        return bool(self._mamba_host[:, row, entry].any())

    @property
    def num_queued(self) -> int:
        return sum(len(v) for v in self._blocks)

    def stage(self, st: Staging) -> StagedAppends | None:
        """The queued entries into the step's staging buffer (applied by `apply` after its copy)."""
        if not self._blocks:
            return None
        index = np.concatenate(self._index)
        blocks = np.concatenate([np.asarray(v, dtype=np.int32) for v in self._blocks])
        self._index, self._blocks = [], []
        if self.host is not None:
            self.host.reshape(-1)[index] = blocks
        return StagedAppends(st.put(index), st.put(blocks))

    def apply(self, st: Staging, staged: StagedAppends | None) -> None:
        if staged is not None:
            self.tables.view(-1)[st.view(staged.index).long()] = st.view(staged.blocks)

    # ---- what a step reads -----------------------------------------------------------------------
    def slot_mapping(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[groups, tokens] cache slot of each token (row, position) in every group; -1 where the
        entry is the null block, which never takes a write."""
        bs = self.block_size
        blocks = self.tables[:, rows, positions // bs].long()
        return torch.where(blocks > 0, blocks * bs + positions % bs, -1)

    def of_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.tables[:, rows]

    def mamba_lookup(self, rows: torch.Tensor) -> PageLookup | None:
        if self.mamba_groups is None:
            return None
        return table_lookup(self.tables, self.mamba_groups, rows)

    # ---- the invariant -----------------------------------------------------------------------------
    def check(self, req_id: str, row: int, num_computed: int, num_new: int) -> None:
        """Every entry a step reads is a real block: [first_needed_block(num_computed), end) (a
        Mamba group: the entries holding the state read and the state written)."""
        bs, c, n = self.block_size, num_computed, num_new
        end = -(-(c + n) // bs)
        for g, first in enumerate(self._first_needed):
            lo = first(c)
            entries = self.host[g, row, lo:end]
            if self.plan.groups[g].spec.kind == MAMBA:
                # A Mamba step reads entry (c-1)//B and writes (c+n-1)//B; the block ends in
                # between are checkpoints only where the manager kept them.
                entries = self.host[g, row, [(c + n - 1) // bs] + ([(c - 1) // bs] if c else [])]
            if end > self.num_entries[g, row] or (entries == 0).any():
                raise AssertionError(f"request {req_id}, group {g}: the step reads entries [{lo}, {end}) "
                                     f"of its table, which has {int(self.num_entries[g, row])} with nulls at "
                                     f"{(np.nonzero(entries == 0)[0] + lo).tolist()}")

    def row(self, row: int) -> list[list[int]]:
        """A row's tables as the batch holds them (tests)."""
        return [self.tables[g, row, :int(self.num_entries[g, row])].tolist() for g in range(self.num_groups)]
