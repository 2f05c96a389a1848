"""The central scheduler: continuous batching over the single hybrid KV cache manager.

Each step: running requests first, oldest first (a decode token each, or the next chunk of a
prefill), then waiting requests in arrival order while the token budget, the cap on running
requests and the pool allow. A prompt longer than the remaining budget is split across steps
(chunked prefill), so decodes are never starved. When the pool runs short, the newest running
request is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed (its prefix cache hits make that cheap); outputs are the same as without preemption.

Scheduling may run one step ahead of the results (overlapped, as vLLM's async scheduling): a
step's tokens count as computed when it is scheduled, and each token it will sample is a
placeholder until its value arrives (`Request.num_output_placeholders`). The next step already
computes a placeholder's position: the workers feed it the token they sampled, which never makes
the round trip through the host. A request that will surely end once its placeholders arrive
(max_tokens, max_model_len) is not scheduled again, and a preempted request is readmitted only
once its last token is known. A request with structured outputs is scheduled like any other, but
its step samples only with its grammar's mask, which depends on the token in flight: the engine
asks for the masks of a step (`grammar_masks`) once the step before has returned its tokens and
the matchers have taken them, while the workers run that step's forward. `update` applies a step's
sampled tokens and the stop rules (one place for when a request stops; a grammar's matcher accepts
each token there); results for a request that finished meanwhile are dropped.
"""
from __future__ import annotations

import enum
import itertools
from collections import deque
from dataclasses import dataclass, field

from distengine.kv_cache.manager import KVCacheManager
from distengine.kv_cache.plan import KVCachePlan
from distengine.request import Request
from distengine.sampling_params import SamplingParams
from distengine.step import GrammarMasks, NewRequest, ScheduledRequest, StepOutput, StepPlan
from distengine.structured_outputs import fill_bitmasks


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class EngineRequest(Request):
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset[int] = frozenset()
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = -1  # prefix-cache hit at the first admission
    in_runner: bool = False  # the workers hold its state (they drop it on preemption)
    grammar: RequestGrammar | None = None  # structured outputs: its matcher (the engine core sets it)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


@dataclass
class RequestUpdate:
    """What one step produced for one request: its new token and, when it ended, why. A request
    the driver could not serve (`failed`) gets no token: finish_reason "error", the message in
    stop_reason."""
    req_id: str
    token_id: int
    logprobs: dict[int, float] | None = None  # the sampled token and the top-k, when asked
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens its first admission found in the prefix cache
    # With its first token, when asked: each prompt token's logprob and the top-k (None for the
    # first token), and each prompt token's rank in the vocabulary (1: the most likely).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None

    @property
    def failed(self) -> bool:
        return self.finish_reason == "error"


@dataclass
class SchedulerStats:
    running: int
    waiting: int
    kv_usage: float
    peak_kv_usage: float
    prefix_cache_hit_rate: float
    preemptions: int
    prefix_cache_queries: int = 0  # prompt tokens looked up so far
    prefix_cache_hits: int = 0     # ... and found


class Scheduler:
    def __init__(self, plan: KVCachePlan, num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True) -> None:
        self.plan = plan
        self.max_model_len = plan.max_model_len
        self.manager = KVCacheManager(plan, num_blocks, enable_caching=enable_prefix_caching)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.finished_since_last_step: list[str] = []
        self.num_preemptions = 0
        self.peak_kv_usage = 0.0
        self._step_ids = itertools.count()
        self.failed: list[RequestUpdate] = []  # requests ended by an error on the driver, not yet reported
        # step id -> the requests it samples, in plan order (what its output's tokens belong to).
        self._in_flight: dict[int, list[EngineRequest]] = {}
        # step id -> its sampling requests with a grammar, until their masks are asked for.
        self._grammar_rows: dict[int, list[EngineRequest]] = {}

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        if req.sampling.num_children > 1:
            raise ValueError("a request of several completions (n, best_of) reaches the engine as one request "
                             "per completion: the front ends (LLM, AsyncLLM) fork it (distengine.parallel_sampling)")
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if req.num_prompt_tokens >= self.max_model_len:
            raise ValueError(f"the prompt ({req.num_prompt_tokens} tokens) is longer than max_model_len "
                             f"({self.max_model_len}) allows: at most {self.max_model_len - 1} prompt tokens")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Finish a request now, in any state; its blocks go back to the pool at once."""
        req = self.requests.get(request_id)
        if req is None or req.status == Status.FINISHED:
            return False
        self._finish(req, "abort")
        return True

    def finish_request(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> None:
        """Used by the engine for conditions it checks itself (stop strings). A request that has
        ended meanwhile (its engine ran on while the stop string was found elsewhere) stays as it is."""
        req = self.requests.get(request_id)
        if req is not None and req.status != Status.FINISHED:
            self._finish(req, reason, stop_reason)

    def _finish(self, req: EngineRequest, reason: str, stop_reason: int | str | None = None) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        self.manager.free(req)
        req.grammar = None
        req.status, req.finish_reason, req.stop_reason = Status.FINISHED, reason, stop_reason
        if req.in_runner:
            self.finished_since_last_step.append(req.request_id)
            req.in_runner = False
        del self.requests[req.request_id]

    def fail(self, req: EngineRequest, error: BaseException | str) -> None:
        """End a request the driver could not serve (its blocks back to the pool); the others go on."""
        message = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
        self._finish(req, "error", message)
        self.failed.append(RequestUpdate(req.request_id, -1, finish_reason="error", stop_reason=message))

    def take_failed(self) -> list[RequestUpdate]:
        failed, self.failed = self.failed, []
        return failed

    def drop_from_step(self, plan: StepPlan, req_ids: list[str], error: BaseException) -> None:
        """Take requests out of a step that has not run (it could not be sent) and fail them."""
        drop = set(req_ids)
        new = {r.req_id for r in plan.new_requests}
        plan.new_requests = [r for r in plan.new_requests if r.req_id not in drop]
        plan.scheduled = [s for s in plan.scheduled if s.req_id not in drop]
        if plan.step_id in self._in_flight:
            self._in_flight[plan.step_id] = [r for r in self._in_flight[plan.step_id] if r.request_id not in drop]
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.in_runner = False  # this step would have sent it
            if rid not in new:
                plan.finished_req_ids.append(rid)  # the workers hold it from an earlier step
            self.fail(req, error)

    def forget_lost_steps(self, step_id: int) -> None:
        """Outputs come back in step order: an output of `step_id` (or none at all for it, when
        the workers had none pending) means the steps before it in flight lost theirs (a caller
        interrupted while it waited). Their requests cannot go on from what the host knows."""
        for lost in [k for k in self._in_flight if k < step_id]:
            self._grammar_rows.pop(lost, None)
            for req in self._in_flight.pop(lost):
                if req.status != Status.FINISHED:
                    self.fail(req, f"step {lost}'s output was lost (its caller was interrupted)")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def has_in_flight(self) -> bool:
        """A step that sampled has not returned its tokens yet."""
        return bool(self._in_flight)

    def stats(self) -> SchedulerStats:
        prefix = self.manager.prefix_cache_stats
        return SchedulerStats(len(self.running), len(self.waiting), self.manager.usage, self.peak_kv_usage,
                              prefix.hit_rate, self.num_preemptions, prefix.queries, prefix.hits)

    # ---- one step ------------------------------------------------------------------------
    def _tokens_to_compute(self, req: EngineRequest) -> int:
        """Tokens of `req` not yet scheduled; 0 when the tokens in flight will end it anyway."""
        pending = req.num_output_placeholders
        if pending:
            sp = req.sampling
            if sp.max_tokens is not None and req.num_output_tokens + pending >= sp.max_tokens:
                return 0
            if req.num_tokens + pending >= self.max_model_len:
                return 0
        return req.num_tokens + pending - req.num_computed_tokens

    def schedule(self) -> StepPlan:
        """The next step. Its tokens count as computed from now on (see the module docstring)."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int, tuple[list[int], ...]]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(self._tokens_to_compute(req), budget)
            if n <= 0:
                i += 1
                continue
            try:
                appended = self.manager.allocate_slots(req, n)
                while appended is None and n > 1 and self.running[-1] is req:
                    # It would preempt itself (and start over, forever): a smaller prefill chunk
                    # first (sliding-window groups free what left the window between chunks).
                    n //= 2
                    appended = self.manager.allocate_slots(req, n)
            except Exception as e:  # noqa: BLE001 - this request fails, the step goes on
                self.fail(req, e)
                continue
            if appended is None:
                self._preempt(self.running[-1])
                continue  # retry this request (unless it was the one preempted)
            scheduled.append((req, n, appended))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_output_placeholders:
                break  # preempted with a token still in flight: readmitted once it is known (FCFS)
            try:
                hit, n, appended = self._admit(req, budget)
            except Exception as e:  # noqa: BLE001 - this request fails, the step goes on
                self.fail(req, e)
                continue
            if appended is None:
                break  # FCFS: nothing behind it jumps the queue
            self.waiting.popleft()
            req.num_computed_tokens = hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit
            req.status = Status.RUNNING
            self.running.append(req)
            scheduled.append((req, n, appended))
            budget -= n
        self.peak_kv_usage = max(self.peak_kv_usage, self.manager.usage)
        return self._plan(scheduled)

    def _admit(self, req: EngineRequest, budget: int) -> tuple[int, int, tuple[list[int], ...] | None]:
        """(prefix hit, tokens to compute, blocks appended or None) of a waiting request."""
        if req.sampling.prompt_logprobs is None:
            blocks, hit = self.manager.get_computed_blocks(req)
        else:  # every prompt position's logits are wanted: no hit
            blocks, hit = self.manager.coordinator.empty_blocks, 0
        n = min(req.num_tokens - hit, budget)
        appended = self.manager.allocate_slots(req, n, hit, blocks)
        if appended is None and hit and not self.running:
            # A prefix hit's pages are held while the step reads them (a Mamba state): a
            # pool that small serves the request from scratch.
            hit, blocks = 0, None
            n = min(req.num_tokens, budget)
            appended = self.manager.allocate_slots(req, n)
        while appended is None and n > 1 and not self.running:
            # Nothing running will free blocks: a smaller prefill chunk, not a dead engine.
            n //= 2
            appended = self.manager.allocate_slots(req, n, hit, blocks)
        return hit, n, appended

    def _preempt(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self.manager.free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        if req.in_runner:
            self.finished_since_last_step.append(req.request_id)  # the workers drop their copy
            req.in_runner = False
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _plan(self, scheduled: list[tuple[EngineRequest, int, tuple[list[int], ...]]]) -> StepPlan:
        plan = StepPlan(next(self._step_ids), finished_req_ids=self.finished_since_last_step)
        grammar_rows: list[EngineRequest] = []
        self.finished_since_last_step = []
        samplers = []
        for req, n, appended in scheduled:
            start = req.num_computed_tokens
            if not req.in_runner:
                # Whole tables once (a prefix hit's blocks were not appended by this step).
                plan.new_requests.append(self._new_request(req))
                new_blocks: list[list[int]] = []
                req.in_runner = True
            else:
                # Only what changed. Entries the manager replaced by the null block (left the
                # window) are not resent: no worker reads them again.
                new_blocks = [list(ids) for ids in appended] if any(appended) else []
            sample = start + n == req.num_tokens + req.num_output_placeholders
            plan.scheduled.append(ScheduledRequest(req.request_id, start, n, req.all_token_ids[start:start + n],
                                                   new_blocks, sample))
            req.num_computed_tokens = start + n
            if sample:
                req.num_output_placeholders += 1
                samplers.append(req)
                if req.grammar is not None:
                    grammar_rows.append(req)
        if grammar_rows:
            self._grammar_rows[plan.step_id] = grammar_rows
        if samplers:
            self._in_flight[plan.step_id] = samplers
        return plan

    def has_grammar_rows(self, step_id: int) -> bool:
        return step_id in self._grammar_rows

    def grammar_masks(self, step_id: int) -> GrammarMasks:
        """The masks of a step's rows with a grammar, from their matchers as they are now: call it
        once every token before that step has been applied (`update`). A request that has finished
        since gets none (its token is dropped)."""
        live = [r for r in self._grammar_rows.pop(step_id, []) if r.grammar is not None]
        masks = fill_bitmasks([r.grammar for r in live]) if live else []
        return GrammarMasks(step_id, {r.request_id: m for r, m in zip(live, masks)})

    def _new_request(self, req: EngineRequest) -> NewRequest:
        sampling = req.sampling.for_workers(req.eos_token_ids)
        return NewRequest(req.request_id, [list(t) for t in self.manager.get_block_ids(req.request_id)],
                          sampling, req.num_output_tokens,
                          list(req.prompt_token_ids) if sampling.reads_prompt or sampling.prompt_logprobs is not None
                          else [],
                          req.output_token_ids if sampling.penalised or sampling.reads_outputs else [])

    def update(self, step_id: int, output: StepOutput | None) -> list[RequestUpdate]:
        """Apply a step's sampled tokens (one per request that sampled, in plan order): append,
        check the stop rules, finish. Returns what each live request got."""
        self.forget_lost_steps(step_id)
        self._grammar_rows.pop(step_id, None)  # (sent, or its requests ended before)
        samplers = self._in_flight.pop(step_id, [])
        if not samplers:
            return []
        if output is None or output.step_id != step_id or len(output.token_ids) != len(samplers):
            got = "nothing" if output is None else f"step {output.step_id} with {len(output.token_ids)} tokens"
            raise RuntimeError(f"step {step_id} sampled for {len(samplers)} requests but the workers returned {got}")
        updates = []
        for k, (req, token) in enumerate(zip(samplers, output.token_ids)):
            if req.status == Status.FINISHED:
                continue  # finished or aborted while this step ran: its token is dropped
            req.num_output_placeholders -= 1
            if req.grammar is not None and not req.grammar.accept(token):
                self.fail(req, f"structured_outputs: the grammar does not allow token {token} after "
                               f"{req.grammar.num_accepted} output tokens")
                continue
            req.append_output_token(token)
            update = RequestUpdate(req.request_id, token, _logprobs(req, output, k, token),
                                   num_cached_tokens=max(req.num_cached_tokens, 0))
            if output.prompt_logprobs and req.request_id in output.prompt_logprobs:
                update.prompt_logprobs, update.prompt_ranks = _prompt_logprobs(output.prompt_logprobs[req.request_id])
            reason = self._stop_reason(req, token)
            if reason is None and req.grammar is not None and req.grammar.terminated:
                reason = "stop", None
            if reason is not None:
                self._finish(req, *reason)
                update.finish_reason, update.stop_reason = req.finish_reason, req.stop_reason
            updates.append(update)
        return updates

    def _stop_reason(self, req: EngineRequest, token: int) -> tuple[str, int | None] | None:
        sp, n_out = req.sampling, req.num_output_tokens
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return "stop", None
            if sp.stop_token_ids and token in sp.stop_token_ids:
                return "stop", token
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return "length", None
        if req.num_tokens >= self.max_model_len:
            return "length", None
        return None


def _prompt_logprobs(rows: list[list]) -> tuple[list[dict[int, float] | None], list[int | None]]:
    """A worker's prompt logprobs (`StepOutput.prompt_logprobs`) in vLLM's shape."""
    tokens, lps, ranks, top_ids, top_lps = rows
    out: list[dict[int, float] | None] = [None]
    for t, lp, ids, vals in zip(tokens, lps, top_ids, top_lps):
        entry = {t: lp}
        entry.update(zip(ids, vals))
        out.append(entry)
    return out, [None, *ranks]


def _logprobs(req: EngineRequest, out: StepOutput, k: int, token: int) -> dict[int, float] | None:
    """vLLM's shape: the sampled token and the request's top-k, token id -> logprob."""
    n = req.sampling.logprobs
    if n is None or out.logprobs is None:
        return None
    entry = {token: out.logprobs[k]}
    if n and out.top_token_ids is not None:
        n = len(out.top_token_ids[k]) if n < 0 else n
        entry.update(zip(out.top_token_ids[k][:n], out.top_logprobs[k][:n]))
    return entry
