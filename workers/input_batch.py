"""The persistent batch on every worker: the requests it runs, kept on the device between steps.

A request gets a row when it enters the workers (`add`) and keeps it until it finishes or is
preempted (`remove`). Per row, on the device: every KV cache group's block table, the last token
the row sampled, its sampling parameters and (for penalties) the prompt's tokens and the output's
token counts. A step changes only what the plan says changed: the block ids appended to tables
and the new rows' state, packed with the step's own inputs into one host buffer and sent with ONE
pinned host-to-device copy (`Staging`). Positions, slot mappings and the input ids of decodes are
derived on the device, so the host's work per step grows with the number of scheduled requests and
new tokens, never with the context length.

The invariant of the tables (the manager's, kept here): entry i of a row's table in a group covers
tokens [i*B, (i+1)*B). Entries the manager replaced by the null block (blocks that left a sliding
window or a past local chunk) are never resent, so here they keep their old block id; no kernel
reads them, because a step reads only the entries from `first_needed_block(num_computed)` up to
the end of its tokens, and those are never null. `debug_checks` asserts exactly that every step.

Row `max_num_seqs` is the padding row: all-null tables, never assigned. Padded slots of a CUDA
graph's batch point at it with a context length of 0, so they read and write nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from distengine.kv_cache.plan import KVCachePlan
from distengine.step import NewRequest, ScheduledRequest
from kernels.mamba_ssd import SSD_MAX_CHUNK
from workers.kv_cache import mamba_group_ids
from workers.layers.attention import AttentionMetadata
from workers.mamba_metadata import MambaMetadata, decode_metadata, plan_chunks, prefill_metadata, table_lookup
from workers.sampler import RowParams, SamplingTensors, row_params

_ALIGN = 4  # int32 elements per 16 bytes: every section starts aligned (Triton specialises pointer alignment)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Staging:
    """One step's host inputs in one int32 buffer, copied to the device in one copy.

    Sections are packed back to back, each 16-byte aligned. Two pinned host buffers alternate,
    so packing step N+1 never overwrites step N's buffer while its copy may still be queued; a
    buffer is reused only after its copy's event has completed. Buffers grow when a step needs
    more (rare: admission steps with long prefix hits)."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.host: list[torch.Tensor] = []
        self.events: list = [None, None]
        self.dev = torch.empty(0, dtype=torch.int32, device=device)
        self.k = 0
        self.used = 0
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        for e in self.events:
            if e is not None:
                e.synchronize()
        self.host = [torch.empty(capacity, dtype=torch.int32, pin_memory=self.cuda) for _ in range(2)]
        self.np = [h.numpy() for h in self.host]
        self.dev = torch.empty(capacity, dtype=torch.int32, device=self.device)
        self.events = [None, None]

    def begin(self, upper_bound: int) -> None:
        """Start packing a step that needs at most `upper_bound` int32 elements."""
        if upper_bound > self.host[0].numel():
            self._grow(_round_up(upper_bound * 2, 1 << 16))
        self.k ^= 1
        if self.events[self.k] is not None:
            self.events[self.k].synchronize()  # normally long done: a step ago
        self.used = 0

    def put(self, values, dtype=np.int32) -> tuple[int, int, np.dtype]:
        """Append a section; returns its handle (offset, length, dtype)."""
        arr = np.asarray(values, dtype=dtype)
        n32 = arr.size * arr.itemsize // 4
        off = self.used
        self.np[self.k][off:off + n32] = arr.reshape(-1).view(np.int32)
        self.used = off + _round_up(max(n32, 1), _ALIGN)
        return off, arr.size, np.dtype(dtype)

    def commit(self) -> None:
        """The one host-to-device copy of the step."""
        n = self.used
        self.dev[:n].copy_(self.host[self.k][:n], non_blocking=True)
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
            self.events[self.k] = ev

    def view(self, handle: tuple[int, int, np.dtype]) -> torch.Tensor:
        off, n, dtype = handle
        if dtype == np.int32:
            return self.dev[off:off + n]
        torch_dtype = {np.dtype(np.float32): torch.float32, np.dtype(np.int64): torch.int64}[dtype]
        words = n * dtype.itemsize // 4
        return self.dev[off:off + words].view(torch_dtype)


@dataclass
class StepInputs:
    """One step as the runner runs it (built by `InputBatch.prepare`)."""
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    graph_size: int | None          # the CUDA graph batch size to replay, or None: eager
    sample_req_ids: list[str]       # the requests that sample, in plan order
    sample_seq_index: np.ndarray    # which of the step's sequences sample (decode graphs)
    sample_rows_np: np.ndarray
    # Device views of the staged sections.
    sections: dict


class InputBatch:
    def __init__(self, plan: KVCachePlan, max_num_seqs: int, vocab_size: int, device: torch.device,
                 debug_checks: bool = False) -> None:
        self.plan, self.device, self.debug = plan, device, debug_checks
        self.block_size = plan.block_size
        self.max_model_len = plan.max_model_len
        self.num_groups = len(plan.groups)
        self.vocab_size = V = int(vocab_size)
        self.max_num_seqs = R = max_num_seqs
        self.pad_row = R
        # Table width: every position up to max_model_len; rounded up to 16 bytes per row.
        self.width = W = _round_up(-(-self.max_model_len // self.block_size), _ALIGN)
        dev = dict(device=device)
        self.tables = torch.zeros(self.num_groups, R + 1, W, dtype=torch.int32, **dev)
        self.last_token = torch.zeros(R + 1, dtype=torch.int64, **dev)
        # Sampling state, one entry per row (defaults: "off").
        f32 = dict(dtype=torch.float32, **dev)
        self.temperature = torch.ones(R + 1, **f32)
        self.top_k = torch.full((R + 1,), V, dtype=torch.int64, **dev)
        self.top_p = torch.ones(R + 1, **f32)
        self.min_p = torch.zeros(R + 1, **f32)
        self.presence = torch.zeros(R + 1, **f32)
        self.frequency = torch.zeros(R + 1, **f32)
        self.repetition = torch.ones(R + 1, **f32)
        self.seed = torch.zeros(R + 1, dtype=torch.int64, **dev)
        self.has_seed = torch.zeros(R + 1, dtype=torch.bool, **dev)
        self.out_count = torch.zeros(R + 1, dtype=torch.int64, **dev)
        self.prompt_mask = torch.zeros(R + 1, V, dtype=torch.bool, **dev)
        self.output_counts = torch.zeros(R + 1, V, dtype=torch.int32, **dev)
        # The graphs' fixed inputs: rows, computed tokens (= decode positions), context lengths.
        self.R4 = _round_up(R, _ALIGN)
        self.static = torch.zeros(3, self.R4, dtype=torch.int32, **dev)
        self.arange = torch.arange(max(R, 1) + 1, dtype=torch.int32, **dev)
        self.staging = Staging(device)
        # Host-side state.
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(R - 1, -1, -1))  # pop() gives the lowest free row
        self.params: list[RowParams | None] = [None] * (R + 1)
        self.num_entries = np.zeros((self.num_groups, R + 1), dtype=np.int64)
        self.has_sampled = np.zeros(R + 1, dtype=bool)
        # Per-row flags for the batch flags of the sampler (numpy: O(batch) per step).
        self.flag_greedy = np.ones(R + 1, dtype=bool)
        self.flag_top_k = np.zeros(R + 1, dtype=bool)
        self.flag_top_p = np.zeros(R + 1, dtype=bool)
        self.flag_min_p = np.zeros(R + 1, dtype=bool)
        self.flag_counts = np.zeros(R + 1, dtype=bool)
        self.flag_seeded = np.zeros(R + 1, dtype=bool)
        self.flag_logprobs = np.full(R + 1, -1, dtype=np.int64)  # -1: none asked
        self._new: list[tuple[int, NewRequest, RowParams]] = []
        self._appends: list[tuple[np.ndarray, list[int]]] = []  # new rows' tables, for the next step
        self.host_tables = np.zeros((self.num_groups, R + 1, W), dtype=np.int32) if debug_checks else None
        self._spec_first = [g.spec.first_needed_block for g in plan.groups]
        mamba = mamba_group_ids(plan)
        self.mamba_groups = torch.tensor(mamba, dtype=torch.int64, device=device) if mamba else None

    # ---- rows ------------------------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return len(self.row_of)

    def add(self, req: NewRequest) -> None:
        if req.req_id in self.row_of:
            raise ValueError(f"request {req.req_id} is already in the batch")
        if not self.free_rows:
            raise ValueError(f"the batch is full ({self.max_num_seqs} requests): request {req.req_id} has no row")
        if len(req.block_ids) != self.num_groups:
            raise ValueError(f"request {req.req_id}: {len(req.block_ids)} block tables for {self.num_groups} groups")
        if any(len(t) > self.width for t in req.block_ids):
            raise ValueError(f"request {req.req_id}: a block table longer than max_model_len allows")
        p = row_params(req.sampling, self.vocab_size)
        row = self.free_rows.pop()
        self.row_of[req.req_id] = row
        self.params[row] = p
        # The whole table goes with the next step's appends (from column 0; what a reused row
        # holds beyond it is never read).
        for g, ids in enumerate(req.block_ids):
            if ids:
                self._appends.append((np.arange(len(ids)) + (g * (self.max_num_seqs + 1) + row) * self.width, ids))
            self.num_entries[g, row] = len(ids)
        self.has_sampled[row] = False
        self.flag_greedy[row], self.flag_top_k[row], self.flag_top_p[row] = p.greedy, p.has_top_k, p.top_p < 1.0
        self.flag_min_p[row], self.flag_counts[row], self.flag_seeded[row] = p.min_p > 0.0, p.uses_counts, p.has_seed
        self.flag_logprobs[row] = p.num_logprobs if p.want_logprobs else -1
        self._new.append((row, req, p))

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return  # never added (finished before it reached the workers) or already gone
        self.params[row] = None
        self.free_rows.append(row)

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledRequest], graph_sizes: list[int] | None) -> StepInputs:
        """Pack the step (and the new rows' state) into the staging buffer, copy it once, apply the
        table appends and the new rows on the device; returns what the runner needs."""
        G, W, R4 = self.num_groups, self.width, self.R4
        S = len(scheduled)
        rows = np.empty(S, dtype=np.int32)
        num_computed = np.empty(S, dtype=np.int32)
        qlens = np.empty(S, dtype=np.int32)
        host_ids: list[int] = []
        dev_idx: list[int] = []
        dev_rows: list[int] = []
        host_idx: list[int] = []  # token index of each host token (decode graphs scatter them)
        sample_idx: list[int] = []
        sample_seq: list[int] = []
        sample_ids: list[str] = []
        app_idx: list[np.ndarray] = [i for i, _ in self._appends]
        app_val: list[list[int]] = [v for _, v in self._appends]
        self._appends = []
        t = 0
        for i, s in enumerate(scheduled):
            row = self.row_of.get(s.req_id)
            if row is None:
                raise KeyError(f"step schedules request {s.req_id} that was never sent")
            n, c = s.num_new_tokens, s.num_computed_tokens
            if n < 1 or c < 0 or c + n > self.max_model_len:
                raise ValueError(f"request {s.req_id}: tokens [{c}, {c + n}) outside [0, max_model_len="
                                 f"{self.max_model_len})")
            rows[i], num_computed[i], qlens[i] = row, c, n
            k = len(s.token_ids)
            if k == n - 1:
                if not self.has_sampled[row]:
                    raise ValueError(f"request {s.req_id}: the step expects the token it sampled last, "
                                     f"but it has not sampled yet")
                dev_idx.append(t + n - 1)
                dev_rows.append(row)
            elif k != n:
                raise ValueError(f"request {s.req_id}: {k} token ids for {n} new tokens")
            if k:
                host_ids.extend(s.token_ids)
                host_idx.extend(range(t, t + k))
            if s.new_block_ids:
                if len(s.new_block_ids) != G:
                    raise ValueError(f"request {s.req_id}: appends for {len(s.new_block_ids)} groups, not {G}")
                for g, ids in enumerate(s.new_block_ids):
                    if ids:
                        start = int(self.num_entries[g, row])
                        if start + len(ids) > W:
                            raise ValueError(f"request {s.req_id}: its table would outgrow max_model_len")
                        app_idx.append(np.arange(start, start + len(ids)) + (g * (self.max_num_seqs + 1) + row) * W)
                        app_val.append(ids)
                        self.num_entries[g, row] = start + len(ids)
            if s.sample:
                sample_idx.append(t + n - 1)
                sample_seq.append(i)
                sample_ids.append(s.req_id)
            t += n
        T = t
        seq_lens = num_computed + qlens
        if host_ids:
            arr = np.asarray(host_ids, dtype=np.int64)
            if arr.min() < 0 or arr.max() >= self.vocab_size:
                bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
                raise ValueError(f"token id {bad} outside the vocabulary [0, {self.vocab_size})")
        decode = bool(S) and int(qlens.max()) == 1
        graph_size = None
        if decode and graph_sizes:
            fits = [g for g in graph_sizes if S <= g <= self.max_num_seqs]
            graph_size = fits[0] if fits else None
        P = graph_size or S  # entries of the fixed region that the step reads

        st = self.staging
        new_rows = self._new
        self._new = []
        bound = 3 * R4 + 8 * S + 5 * T + 64 + 2 * sum(len(v) for v in app_val) + 32 * len(new_rows) \
            + sum(len(r.prompt_token_ids) + len(r.output_token_ids) for _, r, _ in new_rows) * 2
        st.begin(bound)
        fixed = st.put(np.zeros(3 * R4, dtype=np.int32))
        region = st.np[st.k][:3 * R4].reshape(3, R4)
        region[0, :S], region[1, :S], region[2, :S] = rows, num_computed, seq_lens
        region[0, S:P], region[1, S:P], region[2, S:P] = self.pad_row, 0, 0
        sec: dict = {"fixed": fixed}
        if not graph_size:
            qsl = np.zeros(S + 1, dtype=np.int32)
            np.cumsum(qlens, out=qsl[1:])
            sec["qsl"] = st.put(qsl)
            sec["qlens"] = st.put(qlens)
            ids = np.zeros(T, dtype=np.int32)
            if host_ids:
                ids[np.asarray(host_idx, dtype=np.int64)] = host_ids
            sec["ids"] = st.put(ids)
            sec["logits_idx"] = st.put(sample_idx)
            if self.mamba_groups is not None and not decode:
                for key, arr in zip(("m_start", "m_seq", "m_entry"),
                                    plan_chunks(num_computed, qlens, self.block_size, SSD_MAX_CHUNK)):
                    sec[key] = st.put(arr)
            if dev_idx:
                sec["dev_idx"], sec["dev_rows"] = st.put(dev_idx), st.put(dev_rows)
        elif host_ids:
            # A decode graph reads every input token from last_token: put the host's there first.
            sec["host_rows"] = st.put(rows[np.asarray([i for i, s in enumerate(scheduled) if s.token_ids])])
            sec["host_tok"] = st.put(host_ids)
        sample_rows = rows[np.asarray(sample_seq, dtype=np.int64)] if sample_seq else np.empty(0, np.int32)
        sec["sample_rows"] = st.put(sample_rows)
        if graph_size and len(sample_seq) != S:
            sec["sample_seq"] = st.put(sample_seq)
        if app_val:
            sec["app_idx"] = st.put(np.concatenate(app_idx))
            sec["app_val"] = st.put(np.concatenate([np.asarray(v, dtype=np.int32) for v in app_val]))
            if self.host_tables is not None:
                self.host_tables.reshape(-1)[np.concatenate(app_idx)] = np.concatenate(app_val)
        if new_rows:
            self._stage_new_rows(new_rows, sec)
        st.commit()
        self._apply(sec, graph_size is not None)
        if self.debug:
            self.check_tables(scheduled)
        return StepInputs(S, T, int(qlens.max()) if S else 0, int(seq_lens.max()) if S else 0, graph_size,
                          sample_ids, np.asarray(sample_seq, dtype=np.int64), sample_rows, sec)

    def _stage_new_rows(self, new_rows: list[tuple[int, NewRequest, RowParams]], sec: dict) -> None:
        st = self.staging
        ps = [p for _, _, p in new_rows]
        sec["new_rows"] = st.put([r for r, _, _ in new_rows])
        sec["new_f32"] = st.put([[p.temperature, p.top_p, p.min_p, p.presence_penalty, p.frequency_penalty,
                                  p.repetition_penalty] for p in ps], np.float32)
        # A resumed request's seeded draws go on from its outputs so far.
        sec["new_i64"] = st.put([[p.top_k, p.seed, int(p.has_seed), r.num_output_tokens]
                                 for _, r, p in new_rows], np.int64)
        # Rows without penalties keep a former occupant's penalty state: their penalty values
        # (1 and 0) make it a no-op.
        counts = [(row, r) for row, r, p in new_rows if p.uses_counts]
        if counts:
            sec["pen_rows"] = st.put([row for row, _ in counts])
            pr = [(row, t) for row, r in counts for t in r.prompt_token_ids]
            out = [(row, t) for row, r in counts for t in r.output_token_ids]
            if pr:
                sec["prompt_pairs"] = st.put(np.asarray(pr, dtype=np.int32).T.copy())
            if out:
                sec["output_pairs"] = st.put(np.asarray(out, dtype=np.int32).T.copy())

    def _apply(self, sec: dict, graph: bool) -> None:
        st = self.staging
        self.static.view(-1).copy_(st.view(sec["fixed"]))
        if "app_idx" in sec:
            self.tables.view(-1)[st.view(sec["app_idx"]).long()] = st.view(sec["app_val"])
        if "new_rows" in sec:
            rows = st.view(sec["new_rows"]).long()
            f = st.view(sec["new_f32"]).view(-1, 6)
            i = st.view(sec["new_i64"]).view(-1, 4)
            for k, t in enumerate((self.temperature, self.top_p, self.min_p, self.presence, self.frequency,
                                   self.repetition)):
                t[rows] = f[:, k]
            self.top_k[rows], self.seed[rows], self.has_seed[rows] = i[:, 0], i[:, 1], i[:, 2].bool()
            self.out_count[rows] = i[:, 3]
            if "pen_rows" in sec:
                pen = st.view(sec["pen_rows"]).long()
                self.prompt_mask[pen] = False
                self.output_counts[pen] = 0
                if "prompt_pairs" in sec:
                    pairs = st.view(sec["prompt_pairs"]).view(2, -1).long()
                    self.prompt_mask[pairs[0], pairs[1]] = True
                if "output_pairs" in sec:
                    pairs = st.view(sec["output_pairs"]).view(2, -1).long()
                    self.output_counts.index_put_((pairs[0], pairs[1]),
                                                  torch.ones_like(pairs[0], dtype=torch.int32), accumulate=True)
        if graph and "host_rows" in sec:
            self.last_token[st.view(sec["host_rows"]).long()] = st.view(sec["host_tok"]).long()

    def reset_static(self) -> None:
        """Every graph input on the padding row (what a capture's warm-up runs on)."""
        self.static[0].fill_(self.pad_row)
        self.static[1:].zero_()

    # ---- model inputs ----------------------------------------------------------------------
    def decode_inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A decode batch of `size` sequences (one token each) read from the fixed region and the
        device state alone: what a CUDA graph captures. Padded entries use the padding row."""
        rows = self.static[0, :size].long()
        pos = self.static[1, :size].long()
        ids = self.last_token[rows]
        blk = self.tables[:, rows, pos // self.block_size].long()  # [G, size]
        slots = torch.where(blk > 0, blk * self.block_size + pos % self.block_size, -1)
        meta = AttentionMetadata(query_start_loc=self.arange[:size + 1], seq_lens=self.static[2, :size],
                                 max_query_len=1, max_seq_len=self.max_model_len, slot_mappings=slots,
                                 block_tables=self.tables[:, rows], mamba=self._mamba(rows, pos, None))
        return ids, pos, meta

    def eager_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input ids, positions, metadata, logits indices) of any step, from the staged sections."""
        st, sec = self.staging, step.sections
        S, T, bs = step.num_seqs, step.num_tokens, self.block_size
        rows = self.static[0, :S].long()
        num_computed = self.static[1, :S].long()
        qsl = st.view(sec["qsl"])
        ids = st.view(sec["ids"]).long()
        if "dev_idx" in sec:
            ids[st.view(sec["dev_idx"]).long()] = self.last_token[st.view(sec["dev_rows"]).long()]
        # Padded to an even count so that every group's slot row starts 16-byte aligned.
        Tp = _round_up(T, 2)
        seq_of_token = torch.repeat_interleave(self.arange[:S].long(), st.view(sec["qlens"]).long(), output_size=T)
        pos = torch.arange(T, device=self.device) - qsl[:-1].long()[seq_of_token] + num_computed[seq_of_token]
        tok_rows = torch.full((Tp,), self.pad_row, dtype=torch.int64, device=self.device)
        tok_rows[:T] = rows[seq_of_token]
        tok_pos = torch.zeros(Tp, dtype=torch.int64, device=self.device)
        tok_pos[:T] = pos
        blk = self.tables[:, tok_rows, tok_pos // bs].long()
        slots = torch.where(blk > 0, blk * bs + tok_pos % bs, -1)[:, :T]
        # A decode step bounds the context by max_model_len, as its CUDA graph does: the same split
        # of the key range, so eager and graph steps compute the same numbers.
        bound = self.max_model_len if step.max_query_len == 1 else step.max_seq_len
        meta = AttentionMetadata(query_start_loc=qsl, seq_lens=self.static[2, :S], max_query_len=step.max_query_len,
                                 max_seq_len=bound, slot_mappings=slots, block_tables=self.tables[:, rows],
                                 mamba=self._mamba(rows, num_computed, sec if step.max_query_len > 1 else None))
        return ids, pos, meta, st.view(sec["logits_idx"]).long()

    def _mamba(self, rows: torch.Tensor, num_computed: torch.Tensor, sec: dict | None) -> MambaMetadata | None:
        """The Mamba layers' pages: a decode's from the device state alone (CUDA graphs), a
        prefill's through the chunks staged by `prepare`."""
        if self.mamba_groups is None:
            return None
        lookup = table_lookup(self.tables, self.mamba_groups, rows)
        if sec is None:
            return decode_metadata(lookup, num_computed, self.block_size)
        st = self.staging
        return prefill_metadata(lookup, num_computed, self.block_size, st.view(sec["m_start"]), st.view(sec["m_seq"]),
                                st.view(sec["m_entry"]))

    # ---- sampling --------------------------------------------------------------------------
    def sampling_tensors(self, step: StepInputs, generator: torch.Generator | None) -> SamplingTensors:
        rows_np = step.sample_rows_np
        rows = self.staging.view(step.sections["sample_rows"]).long()
        n = len(rows_np)
        greedy = self.flag_greedy[rows_np]
        sampled = ~greedy
        lp = self.flag_logprobs[rows_np]
        flags = dict(num_logprobs=int(max(lp.max(initial=-1), 0)), any_penalties=bool(self.flag_counts[rows_np].any()),
                     any_top_k=bool((self.flag_top_k[rows_np] & sampled).any()),
                     any_top_p=bool((self.flag_top_p[rows_np] & sampled).any()),
                     any_min_p=bool((self.flag_min_p[rows_np] & sampled).any()), all_greedy=bool(greedy.all()),
                     any_seeded=bool((self.flag_seeded[rows_np] & sampled).any()),
                     want_logprobs=bool((lp >= 0).any()),
                     all_seeded=bool(sampled.any() and self.flag_seeded[rows_np][sampled].all()))
        empty = torch.empty(n, device=self.device)
        need_sampling = not flags["all_greedy"]
        pen = flags["any_penalties"]
        rep_mask = pen and any(self.params[r].repetition_penalty != 1.0 for r in rows_np)

        def take(t: torch.Tensor, need: bool) -> torch.Tensor:
            return t[rows] if need else empty

        return SamplingTensors(
            temperature=take(self.temperature, need_sampling), top_k=take(self.top_k, flags["any_top_k"]),
            top_p=take(self.top_p, flags["any_top_p"]), min_p=take(self.min_p, flags["any_min_p"]),
            presence_penalty=take(self.presence, pen), frequency_penalty=take(self.frequency, pen),
            repetition_penalty=take(self.repetition, pen), seeds=take(self.seed, flags["any_seeded"]),
            has_seed=take(self.has_seed, flags["any_seeded"]),
            output_token_counts=take(self.out_count, flags["any_seeded"]),
            prompt_mask=self.prompt_mask[rows] if rep_mask else None,
            output_counts=self.output_counts[rows] if pen else None, generator=generator, **flags)

    def record_sampled(self, step: StepInputs, tokens: torch.Tensor, penalties: bool) -> None:
        """The sampled tokens become the rows' last tokens (the next decode's inputs)."""
        rows = self.staging.view(step.sections["sample_rows"]).long()
        self.last_token[rows] = tokens
        self.out_count[rows] += 1
        if penalties:
            self.output_counts.index_put_((rows, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
        self.has_sampled[step.sample_rows_np] = True

    # ---- the invariant ---------------------------------------------------------------------
    def check_tables(self, scheduled: list[ScheduledRequest]) -> None:
        """Every entry a step reads is a real block: [first_needed_block(num_computed), end) (a
        Mamba group: the entries holding the state read and the state written)."""
        bs = self.block_size
        for s in scheduled:
            row = self.row_of[s.req_id]
            c, n = s.num_computed_tokens, s.num_new_tokens
            end = -(-(c + n) // bs)
            for g, first in enumerate(self._spec_first):
                lo = first(c)
                entries = self.host_tables[g, row, lo:end]
                if self.plan.groups[g].spec.kind == "mamba":
                    # A Mamba step reads entry (c-1)//B and writes (c+n-1)//B; the block ends in
                    # between are checkpoints only where the manager kept them.
                    entries = self.host_tables[g, row, [(c + n - 1) // bs] + ([(c - 1) // bs] if c else [])]
                if end > self.num_entries[g, row] or (entries == 0).any():
                    raise AssertionError(f"request {s.req_id}, group {g}: the step reads entries [{lo}, {end}) "
                                         f"of its table, which has {int(self.num_entries[g, row])} with nulls at "
                                         f"{(np.nonzero(entries == 0)[0] + lo).tolist()}")

    def table_rows(self, req_id: str) -> list[list[int]]:
        """A request's tables as this batch holds them (tests)."""
        row = self.row_of[req_id]
        return [self.tables[g, row, :int(self.num_entries[g, row])].tolist() for g in range(self.num_groups)]
