"""The persistent batch on every worker: the requests it runs, kept on the device between steps,
and each step's model inputs built from them.

A request gets a row when it enters the workers (`add`) and keeps it until it finishes or is
preempted (`remove`). Per row, on the device: its block tables (`workers.block_tables`), the last
token it sampled and its sampling state (`workers.sampling_state`). A step changes only what the
plan says changed: the block ids appended to tables and the new rows' state, packed with the
step's own inputs into one host buffer and sent with ONE pinned host-to-device copy
(`workers.staging`). Positions, slot mappings and the input ids of decodes are derived on the
device, so the host's work per step grows with the number of scheduled requests and new tokens,
never with the context length.

A decode step in a CUDA graph reads its inputs from a fixed region of the device (`static`: rows,
computed tokens, context lengths: the staging buffer's first section, written in place by the
step's copy) and the device state alone (`decode_inputs`); any other step reads the staged
sections too (`eager_inputs`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from distengine.kv_cache.plan import KVCachePlan
from distengine.step import NewRequest, RequestSampling, ScheduledRequest
from kernels.decode_inputs import decode_inputs
from kernels.mamba_ssd import SSD_MAX_CHUNK
from workers.block_tables import BlockTables, StagedAppends
from workers.layers.attention import AttentionMetadata
from workers.mamba_metadata import MambaMetadata, decode_metadata, plan_chunks, prefill_metadata
from workers.ops import greedy_pick_op
from workers.sampler import SamplingTensors
from workers.sampling_state import SamplingState, StagedRows
from workers.staging import ALIGN, Section, Staging, round_up


@dataclass
class ModelInputs:
    """What the model's forward takes, and which of its output rows are sampled."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor | None = None


@dataclass
class StagedStep:
    """One step's own sections of the staging buffer (None: the step has none of that kind)."""
    # [3, R4]: rows, computed tokens, context lengths; packed first, into the fixed region
    fixed: Section
    sample_rows: Section                # the rows that sample, in plan order
    query_start: Section | None = None  # eager steps: [S + 1] token offsets of the sequences
    query_lens: Section | None = None
    token_ids: Section | None = None    # every token, those sampled on the device as 0 until filled
    logits_indices: Section | None = None
    device_token_index: Section | None = None  # tokens that are a row's last sampled token ...
    device_token_rows: Section | None = None   # ... and those rows
    graph_token_rows: Section | None = None    # decode graphs: rows whose token the host sends ...
    graph_token_ids: Section | None = None     # ... and those tokens
    sample_seq: Section | None = None   # decode graphs: the sequences that sample, when not all
    chunk_start: Section | None = None  # Mamba prefills: the scan chunks (workers.mamba_metadata)
    chunk_seq: Section | None = None
    chunk_entry: Section | None = None
    appends: StagedAppends | None = None
    new_rows: StagedRows | None = None


@dataclass
class StepInputs:
    """One step as the runner runs it (built by `InputBatch.prepare`)."""
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    graph_size: int | None          # the CUDA graph batch size to replay, or None: eager
    prompt_lens: tuple[int, ...] | None  # every sequence's query length, when each starts at position 0
    sample_req_ids: list[str]       # the requests that sample, in plan order
    sample_rows_np: np.ndarray
    staged: StagedStep = field(repr=False)


class InputBatch:
    def __init__(self, plan: KVCachePlan, max_num_seqs: int, vocab_size: int, device: torch.device,
                 debug_checks: bool = False) -> None:
        self.plan, self.device, self.debug = plan, device, debug_checks
        self.block_size = plan.block_size
        self.max_model_len = plan.max_model_len
        self.vocab_size = int(vocab_size)
        self.max_num_seqs = R = max_num_seqs
        self.pad_row = R
        self.tables = BlockTables(plan, R, device, debug_checks)
        self.sampling = SamplingState(R + 1, self.vocab_size, device)
        self.last_token = torch.zeros(R + 1, dtype=torch.int64, device=device)
        # The graphs' fixed inputs: rows, computed tokens (= decode positions), context lengths,
        # the staging buffer's fixed region (the step's copy writes them in place).
        self.R4 = round_up(R, ALIGN)
        self.staging = Staging(device, fixed=3 * self.R4)
        self.static = self.staging.fixed_region.view(3, self.R4)
        self.arange = torch.arange(max(R, 1) + 1, dtype=torch.int32, device=device)
        self.mask_staging = Staging(device, capacity=1 << 10)
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(R - 1, -1, -1))  # pop() gives the lowest free row
        self.has_sampled = np.zeros(R + 1, dtype=bool)

    # ---- rows ------------------------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return len(self.row_of)

    def add(self, req: NewRequest) -> None:
        if req.req_id in self.row_of:
            raise ValueError(f"request {req.req_id} is already in the batch")
        if not self.free_rows:
            raise ValueError(f"the batch is full ({self.max_num_seqs} requests): request {req.req_id} has no row")
        row = self.free_rows[-1]
        self.tables.set_row(req.req_id, row, req.block_ids)
        self.free_rows.pop()
        self.row_of[req.req_id] = row
        self.has_sampled[row] = False
        self.sampling.add(row, req)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return  # never added (finished before it reached the workers) or already gone
        self.free_rows.append(row)

    # ---- one step ------------------------------------------------------------------------------
    def prepare(self, scheduled: list[ScheduledRequest], graph_sizes: list[int] | None) -> StepInputs:
        """Pack the step (and the new rows' state) into the staging buffer, copy it once, apply the
        table appends and the new rows on the device; returns what the runner needs."""
        S = len(scheduled)
        rows = np.empty(S, dtype=np.int32)
        num_computed = np.empty(S, dtype=np.int32)
        qlens = np.empty(S, dtype=np.int32)
        host_ids: list[int] = []
        host_idx: list[int] = []  # token index of each host token
        dev_idx: list[int] = []
        dev_rows: list[int] = []
        sample_idx: list[int] = []
        sample_seq: list[int] = []
        sample_ids: list[str] = []
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
                self.tables.append(s.req_id, row, s.new_block_ids)
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

        st, R4 = self.staging, self.R4
        st.begin(3 * R4 + 8 * S + 5 * T + 64 + 2 * self.tables.num_queued + self.sampling.num_queued_words)
        fixed = st.put(np.zeros(3 * R4, dtype=np.int32))
        region = st.np[st.k][:3 * R4].reshape(3, R4)
        region[0, :S], region[1, :S], region[2, :S] = rows, num_computed, seq_lens
        region[0, S:P], region[1, S:P], region[2, S:P] = self.pad_row, 0, 0
        sample_rows = rows[np.asarray(sample_seq, dtype=np.int64)] if sample_seq else np.empty(0, np.int32)
        staged = StagedStep(fixed, st.put(sample_rows))
        if not graph_size:
            qsl = np.zeros(S + 1, dtype=np.int32)
            np.cumsum(qlens, out=qsl[1:])
            staged.query_start, staged.query_lens = st.put(qsl), st.put(qlens)
            ids = np.zeros(T, dtype=np.int32)
            if host_ids:
                ids[np.asarray(host_idx, dtype=np.int64)] = host_ids
            staged.token_ids, staged.logits_indices = st.put(ids), st.put(sample_idx)
            if self.tables.mamba_groups is not None and not decode:
                start, seq, entry = plan_chunks(num_computed, qlens, self.block_size, SSD_MAX_CHUNK,
                                                lambda s, e: self.tables.holds_state(int(rows[s]), e))
                staged.chunk_start, staged.chunk_seq, staged.chunk_entry = st.put(start), st.put(seq), st.put(entry)
            if dev_idx:
                staged.device_token_index, staged.device_token_rows = st.put(dev_idx), st.put(dev_rows)
        else:
            if host_ids:
                # A decode graph reads every input token from last_token: put the host's there first.
                staged.graph_token_rows = st.put(rows[np.asarray([i for i, s in enumerate(scheduled) if s.token_ids])])
                staged.graph_token_ids = st.put(host_ids)
            if len(sample_seq) != S:
                staged.sample_seq = st.put(sample_seq)
        staged.appends = self.tables.stage(st)
        staged.new_rows = self.sampling.stage(st)
        st.commit()
        self._apply(staged)
        if self.debug:
            for s, row in zip(scheduled, rows.tolist()):
                self.tables.check(s.req_id, row, s.num_computed_tokens, s.num_new_tokens)
        prompt_lens = tuple(int(n) for n in qlens) if S and not num_computed.any() else None
        return StepInputs(S, T, int(qlens.max()) if S else 0, int(seq_lens.max()) if S else 0, graph_size,
                          prompt_lens, sample_ids, sample_rows, staged)

    def _apply(self, staged: StagedStep) -> None:
        st = self.staging
        self.tables.apply(st, staged.appends)
        self.sampling.apply(st, staged.new_rows)
        if staged.graph_token_rows is not None:
            self.last_token[st.view(staged.graph_token_rows).long()] = st.view(staged.graph_token_ids).long()

    def reset_static(self) -> None:
        """Every graph input on the padding row (what a capture's warm-up runs on)."""
        self.static[0].fill_(self.pad_row)
        self.static[1:].zero_()

    # ---- model inputs ----------------------------------------------------------------------
    def decode_inputs(self, size: int) -> ModelInputs:
        """A decode batch of `size` sequences (one token each) read from the fixed region and the
        device state alone: what a CUDA graph captures. Padded entries use the padding row. On a
        GPU one kernel derives them (`kernels.decode_inputs`); `decode_inputs_torch` is its
        reference."""
        if self.device.type != "cuda":
            return self.decode_inputs_torch(size)
        d = decode_inputs(self.static[0, :size], self.static[1, :size], self.last_token, self.tables.tables,
                          self.tables.mamba_groups, self.block_size)
        mamba = MambaMetadata(d.init_pages, d.write_pages) if d.init_pages is not None else None
        meta = AttentionMetadata(query_start_loc=self.arange[:size + 1], seq_lens=self.static[2, :size],
                                 max_query_len=1, max_seq_len=self.max_model_len, slot_mappings=d.slot_mappings,
                                 block_tables=d.block_tables, mamba=mamba)
        return ModelInputs(d.input_ids, d.positions, meta)

    def decode_inputs_torch(self, size: int) -> ModelInputs:
        """`decode_inputs` through torch: the block tables' and Mamba pages' rules as eager steps
        apply them."""
        rows = self.static[0, :size].long()
        pos = self.static[1, :size].long()
        meta = AttentionMetadata(query_start_loc=self.arange[:size + 1], seq_lens=self.static[2, :size],
                                 max_query_len=1, max_seq_len=self.max_model_len,
                                 slot_mappings=self.tables.slot_mapping(rows, pos),
                                 block_tables=self.tables.of_rows(rows), mamba=self._mamba(rows, pos, None))
        return ModelInputs(self.last_token[rows], pos, meta)

    def eager_inputs(self, step: StepInputs) -> ModelInputs:
        """Any step's inputs, from the staged sections."""
        st, staged = self.staging, step.staged
        S, T = step.num_seqs, step.num_tokens
        rows = self.static[0, :S].long()
        num_computed = self.static[1, :S].long()
        qsl = st.view(staged.query_start)
        ids = st.view(staged.token_ids).long()
        if staged.device_token_index is not None:
            ids[st.view(staged.device_token_index).long()] = self.last_token[st.view(staged.device_token_rows).long()]
        # Padded to an even count so that every group's slot row starts 16-byte aligned.
        Tp = round_up(T, 2)
        seq_of_token = torch.repeat_interleave(self.arange[:S].long(), st.view(staged.query_lens).long(),
                                               output_size=T)
        pos = torch.arange(T, device=self.device) - qsl[:-1].long()[seq_of_token] + num_computed[seq_of_token]
        tok_rows = torch.full((Tp,), self.pad_row, dtype=torch.int64, device=self.device)
        tok_rows[:T] = rows[seq_of_token]
        tok_pos = torch.zeros(Tp, dtype=torch.int64, device=self.device)
        tok_pos[:T] = pos
        # A decode step bounds the context by max_model_len, as its CUDA graph does: the same split
        # of the key range, so eager and graph steps compute the same numbers.
        bound = self.max_model_len if step.max_query_len == 1 else step.max_seq_len
        meta = AttentionMetadata(query_start_loc=qsl, seq_lens=self.static[2, :S], max_query_len=step.max_query_len,
                                 max_seq_len=bound, slot_mappings=self.tables.slot_mapping(tok_rows, tok_pos)[:, :T],
                                 block_tables=self.tables.of_rows(rows), prompt_lens=step.prompt_lens,
                                 mamba=self._mamba(rows, num_computed, staged if step.max_query_len > 1 else None))
        return ModelInputs(ids, pos, meta, st.view(staged.logits_indices).long())

    def _mamba(self, rows: torch.Tensor, num_computed: torch.Tensor, staged: StagedStep | None) -> MambaMetadata | None:
        """The Mamba layers' pages: a decode's from the device state alone (CUDA graphs), a
        prefill's through the chunks staged by `prepare`."""
        lookup = self.tables.mamba_lookup(rows)
        if lookup is None:
            return None
        if staged is None:
            return decode_metadata(lookup, num_computed, self.block_size)
        st = self.staging
        return prefill_metadata(lookup, num_computed, self.block_size, st.view(staged.chunk_start),
                                st.view(staged.chunk_seq), st.view(staged.chunk_entry))

    def sample_seq(self, step: StepInputs) -> torch.Tensor:
        """Which of a decode graph's sequences sample, when not all of them do."""
        return self.staging.view(step.staged.sample_seq).long()

    # ---- sampling --------------------------------------------------------------------------
    def sampling_tensors(self, step: StepInputs, generator: torch.Generator | None,
                         masks: dict[str, bytes] | None = None) -> SamplingTensors:
        """`masks`: the grammar bitmasks of some sampling rows (by request id). They travel in a
        staging buffer of their own: a step's masks may come after the next step's inputs were
        packed (the step sampled late)."""
        t = self.sampling.tensors(self.staging.view(step.staged.sample_rows), step.sample_rows_np, generator)
        if masks:
            words = -(-self.vocab_size // 32)
            out = np.full((len(step.sample_req_ids), words), -1, dtype=np.int32)  # no grammar: any token
            unknown = set(masks).difference(step.sample_req_ids)
            if unknown:
                raise ValueError(f"grammar masks for requests that do not sample in this step: {sorted(unknown)[:4]}")
            for k, rid in enumerate(step.sample_req_ids):
                mask = masks.get(rid)
                if mask is None:
                    continue
                if len(mask) != 4 * words:
                    raise ValueError(f"request {rid}: a token bitmask of {len(mask)} bytes; the vocabulary "
                                     f"takes {4 * words}")
                out[k] = np.frombuffer(mask, dtype="<i4")
            ms = self.mask_staging
            ms.begin(out.size)
            section = ms.put(out)
            ms.commit()
            t.token_bitmask = ms.view(section).view(out.shape)
        return t

    def record_sampled(self, step: StepInputs, tokens: torch.Tensor, penalties: bool, history: bool = False) -> None:
        """The sampled tokens become the rows' last tokens (the next decode's inputs)."""
        rows = self.staging.view(step.staged.sample_rows).long()
        self.last_token[rows] = tokens
        self.sampling.record_sampled(rows, tokens, penalties, history)
        self.has_sampled[step.sample_rows_np] = True

    def pick_greedy(self, step: StepInputs, logits: torch.Tensor) -> torch.Tensor:
        """Each sampling row's argmax of `logits`, recorded as `record_sampled` records a token
        (no penalties or history: `SamplingTensors.argmax_only`), in two launches on a GPU."""
        tokens = greedy_pick_op(logits, self.staging.view(step.staged.sample_rows), self.last_token,
                                self.sampling.output_token_count)
        self.has_sampled[step.sample_rows_np] = True
        return tokens

    def table_rows(self, req_id: str) -> list[list[int]]:
        """A request's tables as this batch holds them (tests)."""
        return self.tables.row(self.row_of[req_id])

    # ---- a synthetic step ------------------------------------------------------------------
    def dummy_prefill(self, lengths: list[int]) -> StepInputs:
        """A prefill of sequences of these lengths, every token in block 1 (a throwaway cache's):
        the profiling pass runs the model on it, through the same inputs as a real step. The rows
        are freed again; the returned inputs stay valid until the next `prepare`."""
        ids = [f"\0profile{i}" for i in range(len(lengths))]
        blocks = [-(-n // self.block_size) for n in lengths]
        greedy = RequestSampling()
        for rid, n in zip(ids, blocks):
            self.add(NewRequest(rid, [[1] * n for _ in range(self.tables.num_groups)], greedy))
        try:
            return self.prepare([ScheduledRequest(rid, 0, n, [0] * n, [], True) for rid, n in zip(ids, lengths)], None)
        finally:
            for rid in ids:
                self.remove(rid)
