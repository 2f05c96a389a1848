"""The central scheduler: continuous batching over the single hybrid KV cache manager.

Each step: running requests first, oldest first (a decode token each, or the next chunk of a
prefill), then waiting requests in arrival order while the token budget, the cap on running
requests and the pool allow. A prompt longer than the remaining budget is split across steps
(chunked prefill), so decodes are never starved. When the pool runs short, the newest running
request is preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed (its prefix cache hits make that cheap); outputs are the same as without preemption.

The step sent to the workers is plain data (see `workers.model_runner`): a request's tokens and
block tables once when it (re)enters the runner, then only its new tokens and the block ids
appended to its tables.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

from distengine.kv_cache.manager import KVCacheManager
from distengine.kv_cache.plan import KVCachePlan
from distengine.request import Request
from distengine.sampling_params import SamplingParams


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
    # What the runner holds of this request (it forgets it on preemption).
    runner_tokens: int = 0
    in_runner: bool = False
    # The engine's view of the output (text, detokenizer state, logprobs).
    prompt: str | None = None
    text: str = ""
    detok: object = None
    logprobs: list | None = None

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens


@dataclass
class SchedulerStats:
    running: int
    waiting: int
    kv_usage: float
    peak_kv_usage: float
    prefix_cache_hit_rate: float
    preemptions: int


class Scheduler:
    def __init__(self, plan: KVCachePlan, num_blocks: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True) -> None:
        self.plan = plan
        self.max_model_len = plan.max_model_len
        self.manager = KVCacheManager(plan, num_blocks, enable_caching=enable_prefix_caching)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or max(2048, plan.block_size)
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.finished_since_last_step: list[str] = []
        self.num_preemptions = 0
        self.peak_kv_usage = 0.0

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
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

    def _finish(self, req: EngineRequest, reason: str, stop_reason: int | str | None = None) -> None:
        if req.status == Status.RUNNING:
            self.running.remove(req)
        elif req.status == Status.WAITING:
            self.waiting.remove(req)
        self.manager.free(req)
        req.status, req.finish_reason, req.stop_reason = Status.FINISHED, reason, stop_reason
        if req.in_runner:
            self.finished_since_last_step.append(req.request_id)
        del self.requests[req.request_id]

    def finish_request(self, request_id: str, reason: str, stop_reason: int | str | None = None) -> None:
        """Used by the engine for conditions it checks itself (stop strings)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, reason, stop_reason)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.manager.usage, self.peak_kv_usage,
                              self.manager.prefix_cache_stats.hit_rate, self.num_preemptions)

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> tuple[dict, list[tuple[EngineRequest, int]]]:
        """The step to run: (the runner's plain-data step, [(request, tokens computed)])."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int]] = []
        appended_ids: list[tuple[list[int], ...]] = []  # what allocate_slots appended, per group
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            appended = self.manager.allocate_slots(req, n)
            if appended is None:
                self._preempt(self.running[-1])
                continue  # retry this request (unless it was the one preempted)
            scheduled.append((req, n))
            appended_ids.append(appended)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            blocks, hit = self.manager.get_computed_blocks(req)
            n = min(req.num_tokens - hit, budget)
            appended = self.manager.allocate_slots(req, n, hit, blocks)
            if appended is None:
                break  # FCFS: nothing behind it jumps the queue
            self.waiting.popleft()
            req.num_computed_tokens = hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit
            req.status = Status.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            appended_ids.append(appended)
            budget -= n
        self.peak_kv_usage = max(self.peak_kv_usage, self.manager.usage)
        return self._runner_step(scheduled, appended_ids), scheduled

    def _preempt(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self.manager.free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        if req.in_runner:
            self.finished_since_last_step.append(req.request_id)  # the runner drops its copy
            req.in_runner = False
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _runner_step(self, scheduled: list[tuple[EngineRequest, int]],
                     appended_ids: list[tuple[list[int], ...]]) -> dict:
        step: dict = {"new": [], "scheduled": [], "finished": self.finished_since_last_step}
        self.finished_since_last_step = []
        for (req, n), appended in zip(scheduled, appended_ids):
            if not req.in_runner:
                # Whole tables once (a prefix hit's blocks were not appended by this step).
                step["new"].append({"id": req.request_id, "token_ids": list(req.all_token_ids),
                                    "block_ids": [list(t) for t in self.manager.get_block_ids(req.request_id)],
                                    "sampling": req.sampling.to_worker_dict()})
                new_tokens, new_blocks = [], [[] for _ in appended]
                req.in_runner = True
            else:
                # Only what changed. Entries the manager replaced by the null block (left the
                # window) are not resent: the runner never reads them.
                new_tokens = req.all_token_ids[req.runner_tokens:]
                new_blocks = [list(ids) for ids in appended]
            req.runner_tokens = req.num_tokens
            samples = req.num_computed_tokens + n == req.num_tokens
            step["scheduled"].append({"id": req.request_id, "num_computed": req.num_computed_tokens,
                                      "num_tokens": n, "new_token_ids": new_tokens, "new_block_ids": new_blocks,
                                      "sample": samples})
        return step

    def update(self, scheduled: list[tuple[EngineRequest, int]], sampled: list[int]) -> list[EngineRequest]:
        """Apply a step's results (one sampled token per request that samples, in order);
        returns the requests that finished."""
        tokens = iter(sampled)
        done = []
        for req, n in scheduled:
            samples = req.num_computed_tokens + n == req.num_tokens
            token = next(tokens) if samples else None
            if req.status != Status.RUNNING:
                continue  # aborted meanwhile (its token, if any, is dropped)
            req.num_computed_tokens += n
            if token is None:
                continue  # a prefill chunk: nothing sampled yet
            req.append_output_token(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self._finish(req, *reason)
                done.append(req)
        return done

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
