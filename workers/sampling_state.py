"""The persistent batch's sampling state: each row's sampling parameters and penalty counts, kept
on the device between steps, and what a step gathers from them for the sampler.

A row's record (`RequestSampling`) arrives once, when its request enters the batch; its values
are staged with that step's inputs and scattered into the per-row tensors on the device. Each
step then gathers the rows that sample, without any per-row host work beyond its flags.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from distengine.step import NewRequest, RequestSampling
from workers.sampler import (HISTORY, LogitAdjustments, RowFlags, SamplingTensors, ring_slots, seed_bits,
                             top_k_or_vocab)
from workers.staging import Section, Staging

# The per-row tensors staged as float32 and as int64, each a column of its section: one list for
# both the packing and the scattering, so their orders cannot drift apart.
_F32 = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_I64 = ("top_k", "seed", "has_seed", "output_token_count")


@dataclass
class StagedRows:
    """New rows' sampling state in the step's staging buffer."""
    rows: Section
    f32: Section
    i64: Section
    penalised_rows: Section | None = None  # rows whose counts start again
    prompt_pairs: Section | None = None    # (row, token) of every prompt token, for the repetition penalty
    output_pairs: Section | None = None    # (row, token) of a resumed request's outputs
    history: Section | None = None         # (row, ring slot, token) of a resumed request's last outputs


class SamplingState:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = V = int(vocab_size)
        self.device = device
        f32, i64 = dict(dtype=torch.float32, device=device), dict(dtype=torch.int64, device=device)
        # Defaults are "off"; a row's values are set when its request enters.
        self.f32 = {name: torch.zeros(num_rows, **f32) for name in _F32}
        for name in ("temperature", "top_p", "repetition_penalty"):
            self.f32[name].fill_(1.0)
        self.i64 = {name: torch.zeros(num_rows, **i64) for name in _I64}
        self.i64["top_k"].fill_(V)
        self.prompt_mask = torch.zeros(num_rows, V, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(num_rows, V, dtype=torch.int32, device=device)
        self.history = torch.zeros(num_rows, HISTORY, dtype=torch.int64, device=device)  # bad words' rings
        self.flags = RowFlags(num_rows)
        self._new: list[tuple[int, NewRequest]] = []
        self._records: dict[int, RequestSampling] = {}  # the rows whose records adjust logits

    def add(self, row: int, req: NewRequest) -> None:
        self.flags.set(row, req.sampling, self.vocab_size)
        self._new.append((row, req))
        if req.sampling.adjusts_logits:
            self._records[row] = req.sampling
        else:
            self._records.pop(row, None)

    @property
    def num_queued_words(self) -> int:
        """int32 words the queued rows stage at most."""
        return sum(32 + 2 * (len(r.prompt_token_ids) + len(r.output_token_ids)) + 3 * HISTORY for _, r in self._new)

    def stage(self, st: Staging) -> StagedRows | None:
        if not self._new:
            return None
        new, self._new = self._new, []

        def f32(r: RequestSampling) -> list[float]:
            return [getattr(r, name) for name in _F32]

        def i64(req: NewRequest) -> list[int]:
            r = req.sampling
            # A resumed request's seeded draws go on from its outputs so far.
            values = {"top_k": top_k_or_vocab(r, self.vocab_size), "seed": seed_bits(r),
                      "has_seed": int(r.seed is not None), "output_token_count": req.num_output_tokens}
            return [values[name] for name in _I64]

        staged = StagedRows(st.put([row for row, _ in new]), st.put([f32(r.sampling) for _, r in new], np.float32),
                            st.put([i64(r) for _, r in new], np.int64))
        ring = [(row, slot, token) for row, r in new if r.sampling.reads_outputs
                for slot, token in ring_slots(r.output_token_ids)]
        if ring:
            staged.history = st.put(np.asarray(ring, dtype=np.int32).T.copy())
        # Rows without penalties keep a former occupant's counts: their penalty values (1 and 0)
        # make them a no-op.
        counted = [(row, r) for row, r in new if r.sampling.penalised]
        if counted:
            staged.penalised_rows = st.put([row for row, _ in counted])
            prompt = [(row, t) for row, r in counted for t in r.prompt_token_ids]
            output = [(row, t) for row, r in counted for t in r.output_token_ids]
            if prompt:
                staged.prompt_pairs = st.put(np.asarray(prompt, dtype=np.int32).T.copy())
            if output:
                staged.output_pairs = st.put(np.asarray(output, dtype=np.int32).T.copy())
        return staged

    def apply(self, st: Staging, staged: StagedRows | None) -> None:
        if staged is None:
            return
        rows = st.view(staged.rows).long()
        f32 = st.view(staged.f32).view(-1, len(_F32))
        for k, name in enumerate(_F32):
            self.f32[name][rows] = f32[:, k]
        i64 = st.view(staged.i64).view(-1, len(_I64))
        for k, name in enumerate(_I64):
            self.i64[name][rows] = i64[:, k]
        if staged.history is not None:
            ring = st.view(staged.history).view(3, -1).long()
            self.history[ring[0], ring[1]] = ring[2]
        if staged.penalised_rows is not None:
            counted = st.view(staged.penalised_rows).long()
            self.prompt_mask[counted] = False
            self.output_counts[counted] = 0
            if staged.prompt_pairs is not None:
                pairs = st.view(staged.prompt_pairs).view(2, -1).long()
                self.prompt_mask[pairs[0], pairs[1]] = True
            if staged.output_pairs is not None:
                pairs = st.view(staged.output_pairs).view(2, -1).long()
                self.output_counts.index_put_((pairs[0], pairs[1]), torch.ones_like(pairs[0], dtype=torch.int32),
                                              accumulate=True)

    def tensors(self, rows32: torch.Tensor, rows_np: np.ndarray, generator: torch.Generator | None) -> SamplingTensors:
        """The sampler's inputs for the rows that sample this step (`rows32` on the device, int32,
        the same on the host); a tensor no flag asks for is left empty, and a step that reads no
        row's state (all greedy, say) launches nothing here."""
        flags = self.flags.batch(rows_np)
        empty = torch.empty(len(rows_np), device=self.device)
        pen = flags["any_penalties"]
        long_rows: list[torch.Tensor] = []

        def rows() -> torch.Tensor:  # (cast once, when some tensor is read)
            if not long_rows:
                long_rows.append(rows32.long())
            return long_rows[0]

        def take(t: torch.Tensor, need: bool) -> torch.Tensor:
            return t[rows()] if need else empty

        f, i, seeded = self.f32, self.i64, flags["any_seeded"]
        adjusting = np.flatnonzero(self.flags.adjusts[rows_np])
        adjust = None
        if adjusting.size:
            records = [(int(k), self._records[int(rows_np[k])]) for k in adjusting]
            reads = any(r.reads_outputs for _, r in records)
            adjust = LogitAdjustments.build(records, self.device, self.history[rows()] if reads else None)
        return SamplingTensors(
            temperature=take(f["temperature"], not flags["all_greedy"]), top_k=take(i["top_k"], flags["any_top_k"]),
            top_p=take(f["top_p"], flags["any_top_p"]), min_p=take(f["min_p"], flags["any_min_p"]),
            presence_penalty=take(f["presence_penalty"], pen), frequency_penalty=take(f["frequency_penalty"], pen),
            repetition_penalty=take(f["repetition_penalty"], pen), seeds=take(i["seed"], seeded),
            has_seed=take(i["has_seed"], seeded).bool() if seeded else empty,
            output_token_counts=take(i["output_token_count"], seeded or adjust is not None),
            prompt_mask=self.prompt_mask[rows()] if pen and self.flags.reads_prompt[rows_np].any() else None,
            output_counts=self.output_counts[rows()] if pen else None, generator=generator, adjust=adjust, **flags)

    @property
    def output_token_count(self) -> torch.Tensor:
        """[R] int64: the tokens each row's request has produced."""
        return self.i64["output_token_count"]

    def record_sampled(self, rows: torch.Tensor, tokens: torch.Tensor, penalties: bool, history: bool) -> None:
        """`history`: some row of the step reads its ring (bad words), which every row's sampled
        token then enters (only such rows read it, and they sample in every step they are in)."""
        if history:
            self.history[rows, self.output_token_count[rows] % HISTORY] = tokens
        self.output_token_count[rows] += 1
        if penalties:
            self.output_counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
