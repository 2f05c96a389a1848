"""Batched token sampling for one engine step (vLLM semantics), entirely on the logits' device.

Pipeline of `sample` (row = one request sampled this step):

0. Structured outputs (`token_bitmask`, rows with a grammar): every token whose bit is clear is
   barred (-inf), before anything else (as vLLM applies the grammar's bitmask before its sampler);
   the bits are unpacked on the device. Then the logit adjustments (`LogitAdjustments`, only for rows that ask; vLLM's order, before the
   penalties): `allowed_token_ids` bars every other token (-inf), `logit_bias` adds each bias,
   while a row has fewer than `min_tokens` outputs its stop tokens are barred, and a bad word's
   last token is barred when the row's last outputs are the word's other tokens (a one-token word
   always), read from the row's ring of its last HISTORY outputs on the device.
1. Penalties, on a float32 copy of the logits (the caller's tensor is never modified):
   repetition (tokens seen in prompt or output: positive logits divided by the penalty, negative
   ones multiplied), then frequency (``- freq * count_in_output``), then presence
   (``- pres * (count_in_output > 0)``).
2. Logprobs (when asked) = ``log_softmax`` of the *penalised* logits, before temperature, top-k,
   top-p and min-p.  NOTE: vLLM's default ``raw_logprobs`` mode takes them before penalties; here
   they are taken after penalties, before any other processing (as the engine's spec asks).
3. Greedy rows (temperature 0, as `SamplingParams.for_workers` stores any temperature below
   1e-5) take ``argmax`` of the penalised logits (ties: lowest token id).
4. Other rows: divide by temperature; top-k (keep every token whose logit is >= the k-th largest,
   so ties at the boundary may keep more than k); top-p on the tempered distribution (keep the
   smallest prefix of the descending-sorted tokens whose cumulative probability is >= p, never
   fewer than one token; implemented as vLLM does: drop a token when the ascending cumulative sum
   up to and including it is <= 1 - p); min-p (drop tokens with ``prob < min_p * max_prob``,
   done in logit space as ``logit < max_logit + log(min_p)``; the max token is never dropped by
   top-k/top-p, so applying min-p last equals applying it to the full distribution).
5. Draw with the exponential race: ``argmax(probs / q)``, ``q ~ Exp(1)`` i.i.d. per token,
   computed in log space as ``argmax(logits - log q)`` (same argmax since softmax is a monotone,
   shift-invariant map per row; no softmax, no underflow).  ``q = -log(u)`` with ``u`` uniform
   in (0, 1):

   * unseeded rows: ``u`` from ``torch.rand`` with `SamplingTensors.generator` (the workers
     seed one per rank identically, so every tensor-parallel rank draws the same tokens), or the
     device's default generator when it is None;
   * seeded rows: ``u`` from a counter-based hash of (seed, output_token_count, token id):
     ``row_key = mix(mix(seed) ^ mix(count + c))``, ``z = mix(row_key + (token_id + 1) * golden)``,
     ``u = (2 * (top 23 bits of z) + 1) / 2**24``, where ``mix`` is the splitmix64 finaliser evaluated
     with wrapping int64 tensor arithmetic (logical shifts emulated by shift + mask).  The draw of a
     seeded request therefore depends only on (seed, tokens produced so far, its logits and
     params): it is the same alone or batched, at any row position, across steps, restarts and
     (bit-exactly, for the noise) across CPU and CUDA.

No host synchronisation happens inside `sample`: no scalar reads, no host copies, no
data-dependent shapes; the only Python branches are on the batch flags of `SamplingTensors` and on
tensor shapes.  Memory: a few [N, V] float32 temporaries, plus [N, V] int64 ones for the hash when
any row is seeded, and a sort of [N, V] when any row uses top-k or top-p.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from distengine.step import MAX_BAD_WORD_TOKENS, RequestSampling

__all__ = ["HISTORY", "LogitAdjustments", "SamplingTensors", "ring_slots", "SamplerOutput", "sample", "apply_penalties",
           "apply_token_bitmask", "seeded_uniform"]

_MASK64 = (1 << 64) - 1
HISTORY = MAX_BAD_WORD_TOKENS - 1  # outputs a row's ring keeps: a bad word's tokens before its last


def _i64(c: int) -> int:
    """An unsigned 64-bit constant as the signed int64 with the same bits."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_COUNT_SALT = _i64(0xD1B54A32D192ED03)
_M1 = _i64(0xBF58476D1CE4E5B9)
_M2 = _i64(0x94D049BB133111EB)


def _shr(z: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic on signed ints)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """splitmix64 finaliser on int64 tensors (multiplication wraps mod 2**64)."""
    z = z ^ _shr(z, 30)
    z = z * _M1
    z = z ^ _shr(z, 27)
    z = z * _M2
    return z ^ _shr(z, 31)


def seeded_uniform(seeds: Tensor, counts: Tensor, vocab_size: int) -> Tensor:
    """[N, vocab_size] float32 uniforms in (0, 1), a pure function of (seed, count, token id).

    Values are (2k + 1) / 2**24 for the top 23 bits k of the hash: strictly inside (0, 1) and
    exact in float32 (a 24-bit odd numerator), so u never rounds to 1 (which would make q = 0).
    """
    row_key = _mix64(_mix64(seeds) ^ _mix64(counts + _COUNT_SALT))
    tok = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device) * _GOLDEN
    z = _mix64(row_key.unsqueeze(1) + tok.unsqueeze(0))
    return (_shr(z, 41) * 2 + 1).to(torch.float32) * (2.0 ** -24)


@dataclass
class LogitAdjustments:
    """The step's logit adjustments as sparse entries over its rows (built on the host from the
    few rows that ask, `build`): entry i adds values[i] to logits[rows[i], tokens[i]] while that
    row's output count is below until[i] (-inf bars a token); rows in `allowed_rows` keep only
    the tokens of `allowed_pairs` ([2, P]: row, token)."""
    rows: Tensor                  # [M] int64
    tokens: Tensor                # [M] int64
    values: Tensor                # [M] float32
    until: Tensor                 # [M] int64
    allowed_rows: Tensor | None   # [A] int64
    allowed_pairs: Tensor | None  # [2, P] int64
    # Bad words of two tokens or more: the row, the tokens before the last (padded to HISTORY),
    # how many, the last; `history` [N, HISTORY]: each row's ring of its last outputs (output i
    # at i % HISTORY).
    word_rows: Tensor | None = None    # [B] int64
    word_prefix: Tensor | None = None  # [B, HISTORY] int64
    word_len: Tensor | None = None     # [B] int64
    word_last: Tensor | None = None    # [B] int64
    history: Tensor | None = None

    @classmethod
    def build(cls, records: list[tuple[int, RequestSampling]], device,
              history: Tensor | None = None) -> "LogitAdjustments | None":
        """(row in the step, record) of the rows that adjust; None when none does. The host
        arrays reach the device through pinned memory without waiting for it. `history`: the
        step's rows' rings, needed when a record has a bad word of several tokens."""
        rows, tokens, values, until, allowed_rows, allowed = [], [], [], [], [], []
        word_rows, word_prefix, word_len, word_last = [], [], [], []
        forever = np.iinfo(np.int64).max
        for row, r in records:
            for token, bias in r.logit_bias:
                rows.append(row), tokens.append(token), values.append(bias), until.append(forever)
            if r.min_tokens:
                for token in r.stop_ids:
                    rows.append(row), tokens.append(token), values.append(float("-inf")), until.append(r.min_tokens)
            if r.allowed_token_ids:
                allowed_rows.append(row)
                allowed.extend((row, token) for token in r.allowed_token_ids)
            for word in r.bad_words:
                if len(word) == 1:
                    rows.append(row), tokens.append(word[0]), values.append(float("-inf")), until.append(forever)
                else:
                    word_rows.append(row), word_len.append(len(word) - 1), word_last.append(word[-1])
                    word_prefix.append(list(word[:-1]) + [0] * (HISTORY - len(word) + 1))
        if not rows and not allowed_rows and not word_rows:
            return None
        if word_rows and history is None:
            raise ValueError("bad words of several tokens need the rows' output history")
        dev = torch.device(device)

        def put(a: np.ndarray) -> Tensor:
            t = torch.from_numpy(a)
            return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)

        i64 = np.int64
        words = {}
        if word_rows:
            words = dict(word_rows=put(np.asarray(word_rows, i64)), word_prefix=put(np.asarray(word_prefix, i64)),
                         word_len=put(np.asarray(word_len, i64)), word_last=put(np.asarray(word_last, i64)),
                         history=history)
        return cls(put(np.asarray(rows, i64)), put(np.asarray(tokens, i64)), put(np.asarray(values, np.float32)),
                   put(np.asarray(until, i64)), put(np.asarray(allowed_rows, i64)) if allowed_rows else None,
                   put(np.asarray(allowed, i64).reshape(-1, 2).T.copy()) if allowed_rows else None, **words)

    @property
    def reads_history(self) -> bool:
        return self.word_rows is not None

    def apply(self, x: Tensor, output_counts: Tensor) -> None:
        """In place on float32 logits [N, V]; `output_counts` [N]: each row's outputs so far."""
        if self.allowed_rows is not None:
            keep = torch.ones_like(x, dtype=torch.bool).index_fill_(0, self.allowed_rows, False)
            rows, tokens = self.allowed_pairs
            keep.index_put_((rows, tokens), torch.ones_like(rows, dtype=torch.bool))  # (a scalar would sync)
            x.masked_fill_(~keep, float("-inf"))
        if self.rows.numel():
            live = output_counts[self.rows] < self.until
            x.index_put_((self.rows, self.tokens), torch.where(live, self.values, 0.0), accumulate=True)
        if self.word_rows is not None:
            count, n = output_counts[self.word_rows], self.word_len
            j = torch.arange(HISTORY, device=x.device)
            # the row's last n outputs: outputs count - n .. count - 1, in ring order
            seen = self.history[self.word_rows].gather(1, (count[:, None] - n[:, None] + j[None, :]) % HISTORY)
            hit = ((seen == self.word_prefix) | (j[None, :] >= n[:, None])).all(1) & (count >= n)
            x.index_put_((self.word_rows, self.word_last), torch.where(hit, float("-inf"), 0.0), accumulate=True)


@dataclass
class SamplingTensors:
    """Per-step sampling parameters, one row per request sampled this step (same order as the
    logits rows); tensors live on the logits' device. `build` packs them from per-request records
    and token lists; the workers' persistent batch gathers them from its device-resident rows.

    Conventions: temperature 0 = greedy; top_k off is stored as V;
    top_p 1 = off; min_p 0 = off; presence/frequency 0 = off; repetition 1 = off.
    The penalty state is None when no row needs it.
    """
    temperature: Tensor          # [N] float32
    top_k: Tensor                # [N] int64
    top_p: Tensor                # [N] float32
    min_p: Tensor                # [N] float32
    presence_penalty: Tensor     # [N] float32
    frequency_penalty: Tensor    # [N] float32
    repetition_penalty: Tensor   # [N] float32
    seeds: Tensor                # [N] int64 (seed's low 64 bits, as signed)
    has_seed: Tensor             # [N] bool
    output_token_counts: Tensor  # [N] int64: tokens each request has produced so far
    prompt_mask: Tensor | None   # [N, V] bool: the token occurs in the prompt (repetition penalty)
    output_counts: Tensor | None  # [N, V] int32: occurrences in the output (all penalties)
    num_logprobs: int            # K of top_logprobs (0 = none)
    any_penalties: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    all_greedy: bool
    any_seeded: bool
    want_logprobs: bool = False  # some request asked for logprobs (even logprobs=0): fill .logprobs
    all_seeded: bool = False     # every non-greedy row is seeded: skip torch.rand
    generator: torch.Generator | None = None  # for unseeded rows (every TP rank draws the same)
    adjust: LogitAdjustments | None = None  # (output_token_counts is filled when given)
    # [N, ceil(V / 32)] int32: bit j of word w allows token 32 w + j (rows without a grammar: all set)
    token_bitmask: Tensor | None = None

    @property
    def argmax_only(self) -> bool:
        """Every row takes its argmax and nothing more is asked (no logprobs, penalties, grammar
        masks or logit adjustments): the runner then picks and records the tokens itself, in two
        launches (`kernels.greedy_pick`)."""
        return self.all_greedy and not (self.want_logprobs or self.num_logprobs > 0 or self.any_penalties) and \
            self.adjust is None and self.token_bitmask is None

    @classmethod
    def build(cls, params: list[RequestSampling], prompt_token_ids: list[list[int]],
              output_token_ids: list[list[int]], vocab_size: int, device,
              generator: torch.Generator | None = None, token_bitmask: Tensor | None = None) -> "SamplingTensors":
        """Pack per-request records (checked on the driver: `SamplingParams.for_workers`) and
        token lists; what the profiling pass and the tests sample with."""
        n = len(params)
        if len(prompt_token_ids) != n or len(output_token_ids) != n:
            raise ValueError(f"params ({n}), prompt_token_ids ({len(prompt_token_ids)}) and "
                             f"output_token_ids ({len(output_token_ids)}) must have equal length")
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
        V = int(vocab_size)
        rows = RowFlags(n)
        for i, r in enumerate(params):
            rows.set(i, r, V)
        flags = rows.batch(np.arange(n))
        dev = torch.device(device)
        any_rep = bool(rows.reads_prompt.any())

        def counts(lists: list[list[int]]) -> Tensor:
            out = torch.zeros((n, V), dtype=torch.int32)
            for i, toks in enumerate(lists):
                if toks:
                    out[i] += torch.bincount(torch.tensor(toks, dtype=torch.int64), minlength=V).to(torch.int32)
            return out.to(dev)

        def col(values: list, dtype) -> Tensor:
            return torch.tensor(values, dtype=dtype).to(dev)

        f32 = torch.float32
        return cls(
            temperature=col([r.temperature for r in params], f32),
            top_k=col([top_k_or_vocab(r, V) for r in params], torch.int64),
            top_p=col([r.top_p for r in params], f32), min_p=col([r.min_p for r in params], f32),
            presence_penalty=col([r.presence_penalty for r in params], f32),
            frequency_penalty=col([r.frequency_penalty for r in params], f32),
            repetition_penalty=col([r.repetition_penalty for r in params], f32),
            seeds=col([seed_bits(r) for r in params], torch.int64),
            has_seed=col([r.seed is not None for r in params], torch.bool),
            output_token_counts=torch.tensor([len(o) for o in output_token_ids], dtype=torch.int64).to(dev),
            prompt_mask=counts(prompt_token_ids).gt(0) if any_rep else None,
            output_counts=counts(output_token_ids) if flags["any_penalties"] else None,
            generator=generator, token_bitmask=None if token_bitmask is None else token_bitmask.to(dev),
            adjust=LogitAdjustments.build(
                [(i, r) for i, r in enumerate(params) if r.adjusts_logits], dev,
                _rings(output_token_ids, dev) if any(r.reads_outputs for r in params) else None),
            **flags)


def ring_slots(tokens: list[int]) -> list[tuple[int, int]]:
    """(slot, token) of a row's last outputs in its ring of HISTORY: output i at i % HISTORY."""
    return [(i % HISTORY, tokens[i]) for i in range(max(0, len(tokens) - HISTORY), len(tokens))]


def _rings(output_token_ids: list[list[int]], device) -> Tensor:
    """[N, HISTORY]: each row's ring, as the workers' persistent rows keep them."""
    ring = torch.zeros((len(output_token_ids), HISTORY), dtype=torch.int64)
    for row, tokens in enumerate(output_token_ids):
        for slot, token in ring_slots(tokens):
            ring[row, slot] = token
    return ring.to(device)


class RowFlags:
    """Per-row facts of the requests' sampling records, from which a step's batch flags follow:
    numpy arrays, so that a step's flags cost O(batch) without a Python loop over its rows."""

    def __init__(self, num_rows: int) -> None:
        self.greedy = np.ones(num_rows, dtype=bool)
        self.top_k = np.zeros(num_rows, dtype=bool)
        self.top_p = np.zeros(num_rows, dtype=bool)
        self.min_p = np.zeros(num_rows, dtype=bool)
        self.penalised = np.zeros(num_rows, dtype=bool)
        self.reads_prompt = np.zeros(num_rows, dtype=bool)
        self.seeded = np.zeros(num_rows, dtype=bool)
        self.adjusts = np.zeros(num_rows, dtype=bool)
        self.logprobs = np.full(num_rows, -1, dtype=np.int64)  # -1: none asked

    def set(self, row: int, r: RequestSampling, vocab_size: int) -> None:
        self.greedy[row], self.top_k[row], self.top_p[row] = r.greedy, 0 < r.top_k < vocab_size, r.top_p < 1.0
        self.min_p[row], self.penalised[row], self.reads_prompt[row] = r.min_p > 0.0, r.penalised, r.reads_prompt
        self.seeded[row], self.adjusts[row] = r.seed is not None, r.adjusts_logits
        self.logprobs[row] = num_logprobs(r, vocab_size) if r.logprobs is not None else -1

    def batch(self, rows: np.ndarray) -> dict:
        """`SamplingTensors`' flags for these rows; greedy rows ignore top-k/p, min-p and seeds."""
        greedy = self.greedy[rows]
        sampled = ~greedy
        lp = self.logprobs[rows]
        return dict(num_logprobs=int(max(lp.max(initial=-1), 0)), any_penalties=bool(self.penalised[rows].any()),
                    any_top_k=bool((self.top_k[rows] & sampled).any()),
                    any_top_p=bool((self.top_p[rows] & sampled).any()),
                    any_min_p=bool((self.min_p[rows] & sampled).any()), all_greedy=bool(greedy.all()),
                    any_seeded=bool((self.seeded[rows] & sampled).any()), want_logprobs=bool((lp >= 0).any()),
                    all_seeded=bool(sampled.any() and self.seeded[rows][sampled].all()))


def top_k_or_vocab(r: RequestSampling, vocab_size: int) -> int:
    """The tensors' convention: top-k off is the whole vocabulary."""
    return r.top_k if 0 < r.top_k < vocab_size else vocab_size


def num_logprobs(r: RequestSampling, vocab_size: int) -> int:
    """The top-k logprobs a request asks for (-1: the whole vocabulary), 0 for none."""
    if r.logprobs is None:
        return 0
    return vocab_size if r.logprobs == -1 else min(r.logprobs, vocab_size)


def seed_bits(r: RequestSampling) -> int:
    """The seed as the int64 the counter hash mixes (0 when unseeded: `has_seed` tells)."""
    return _i64(r.seed) if r.seed is not None else 0


@dataclass
class SamplerOutput:
    token_ids: Tensor                    # [N] int64
    logprobs: Tensor | None = None       # [N] float32: log_softmax(penalised logits)[token]
    top_logprobs: Tensor | None = None   # [N, K] float32, descending
    top_token_ids: Tensor | None = None  # [N, K] int64


def apply_token_bitmask(x: Tensor, bitmask: Tensor) -> None:
    """In place on float32 logits [N, V]: -inf where the row's bit is clear."""
    N, V = x.shape
    # As bytes (little-endian words: token 8 k + j is bit j of byte k), so the unpacked bits take
    # one byte per token, not four.
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    allowed = ((bitmask.contiguous().view(torch.uint8).unsqueeze(2) >> shifts) & 1).view(N, -1)[:, :V]
    x.masked_fill_(allowed == 0, float("-inf"))


def apply_penalties(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Repetition, frequency and presence penalties (vLLM semantics) -> new float32 [N, V]."""
    x = logits.to(torch.float32, copy=True)
    out_counts = t.output_counts.to(torch.float32) if t.output_counts is not None else None
    out_mask = out_counts > 0 if out_counts is not None else None
    seen = t.prompt_mask
    if out_mask is not None:
        seen = out_mask if seen is None else seen | out_mask
    if seen is not None:
        pen = torch.where(seen, t.repetition_penalty.unsqueeze(1), 1.0)
        x = torch.where(x > 0, x / pen, x * pen)
    if out_counts is not None:
        x.sub_(t.frequency_penalty.unsqueeze(1) * out_counts)
        x.sub_(t.presence_penalty.unsqueeze(1) * out_mask)
    return x


def _top_k_top_p(x: Tensor, t: SamplingTensors) -> Tensor:
    """Mask (to -inf) tokens outside top-k and then outside the top-p nucleus; returns x."""
    V = x.shape[1]
    sorted_x, order = x.sort(dim=-1, descending=False)
    if t.any_top_k:
        k = torch.where((t.top_k <= 0) | (t.top_k > V), V, t.top_k)
        thresh = sorted_x.gather(1, (V - k).unsqueeze(1))
        sorted_x.masked_fill_(sorted_x < thresh, float("-inf"))
    if t.any_top_p:
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1.0 - t.top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_x.masked_fill_(drop, float("-inf"))
    return x.scatter_(1, order, sorted_x)


def _uniform_noise(t: SamplingTensors, N: int, V: int, device) -> Tensor:
    def unseeded() -> Tensor:
        return torch.rand((N, V), dtype=torch.float32, device=device, generator=t.generator).clamp_min_(2.0 ** -25)

    if t.any_seeded:
        seeded = seeded_uniform(t.seeds, t.output_token_counts, V)
        if t.all_seeded:
            return seeded
        return torch.where(t.has_seed.unsqueeze(1), seeded, unseeded())
    return unseeded()


def _random_sample(x: Tensor, t: SamplingTensors) -> Tensor:
    """Temperature, top-k, top-p, min-p, then exponential race.  Does not modify x."""
    N, V = x.shape
    temp = torch.where(t.temperature == 0.0, 1.0, t.temperature)
    x = x / temp.unsqueeze(1)
    if t.any_top_k or t.any_top_p:
        x = _top_k_top_p(x, t)
    if t.any_min_p:
        floor = x.amax(dim=-1, keepdim=True) + torch.log(t.min_p).unsqueeze(1)  # log 0 = -inf: off
        x.masked_fill_(x < floor, float("-inf"))
    u = _uniform_noise(t, N, V, x.device)
    log_q = u.log_().neg_().log_()  # q = -log u ~ Exp(1), q in (0, inf)
    return x.sub_(log_q).argmax(dim=-1)


def sample(logits: Tensor, t: SamplingTensors) -> SamplerOutput:
    """Sample one token per row of ``logits`` [N, V] (any float dtype; V must equal the
    ``vocab_size`` given to `SamplingTensors.build`, i.e. slice off lm_head padding first).
    The input tensor is not modified.  No host synchronisation."""
    if t.token_bitmask is not None or t.adjust is not None:
        x = logits.to(torch.float32, copy=True)
        if t.token_bitmask is not None:
            apply_token_bitmask(x, t.token_bitmask)
        if t.adjust is not None:
            t.adjust.apply(x, t.output_token_counts)
        if t.any_penalties:
            x = apply_penalties(x, t)
    elif t.any_penalties:
        x = apply_penalties(logits, t)
    elif t.all_greedy and not (t.want_logprobs or t.num_logprobs > 0):
        x = logits  # argmax alone: the same token in the logits' dtype (fp32 holds each value exactly)
    else:
        x = logits.to(torch.float32)  # may alias `logits`: only out-of-place ops on x below

    out = SamplerOutput(token_ids=None)  # type: ignore[arg-type]
    lp = None
    if t.want_logprobs or t.num_logprobs > 0:
        lp = torch.log_softmax(x, dim=-1)
        if t.num_logprobs > 0:
            out.top_logprobs, out.top_token_ids = torch.topk(lp, t.num_logprobs, dim=-1)

    greedy = x.argmax(dim=-1)
    if t.all_greedy:
        tokens = greedy
    else:
        tokens = torch.where(t.temperature == 0.0, greedy, _random_sample(x, t))
    out.token_ids = tokens
    if lp is not None:
        out.logprobs = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    return out
