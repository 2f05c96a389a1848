"""The engine loop as its own piece: schedule, execute, update, one step at a time. `LLM` drives
it for offline generation; a server drives the same loop.

With `async_scheduling` (the default) the loop overlaps host and device: the scheduler prepares
step N+1 while the workers run step N. Each call to `step()` schedules one step, launches it, and
receives the output of the step launched before it, whose tokens it applies (see the scheduler's
docstring for how a step can be scheduled before the previous one's tokens are known). Without
it, each step's output is applied before the next one is scheduled.
"""
from __future__ import annotations

import time

from distengine.config import EngineConfig
from distengine.executor import Executor, create_executor
from distengine.scheduler import EngineRequest, RequestUpdate, Scheduler, SchedulerStats


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor or create_executor(config)
        self.plan = self.executor.plan  # the workers' KV cache plan: what the manager follows
        # The token budget as the workers resolved it where they run (vLLM's default depends on the GPU).
        self.scheduler = Scheduler(self.plan, self.executor.num_blocks, config.max_num_seqs,
                                   self.executor.plan_info["max_num_batched_tokens"], config.enable_prefix_caching)
        # Benchmarks set a list here: one (end time, sequences, tokens, decode only) per step.
        self.step_log: list[tuple[float, int, int, bool]] | None = None

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        self.scheduler.add_request(req)

    def abort(self, req_ids) -> None:
        for rid in req_ids:
            self.scheduler.abort(rid)

    def finish_request(self, req_id: str, reason: str, stop_reason: int | str | None = None) -> None:
        """For the stop conditions the output processor checks (stop strings)."""
        self.scheduler.finish_request(req_id, reason, stop_reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ---- the loop --------------------------------------------------------------------------
    def step(self) -> list[RequestUpdate]:
        """One step: what the requests got from the step whose output arrived now."""
        sched = self.scheduler
        plan = sched.schedule()
        plan.defer_output = self.config.async_scheduling
        if not plan.scheduled and not plan.finished_req_ids and not sched.has_in_flight():
            if sched.waiting and not sched.running:
                head = sched.waiting[0]
                raise RuntimeError(f"request {head.request_id} ({head.num_tokens} tokens) cannot fit in the KV "
                                   f"cache ({sched.manager.pool.num_blocks - 1} blocks)")
            return []
        output = self.executor.execute(plan)
        if self.step_log is not None and plan.scheduled:
            self.step_log.append((time.perf_counter(), len(plan.scheduled), plan.num_tokens,
                                  plan.num_tokens == len(plan.scheduled)))
        if output is None:
            return []
        return sched.update(output.step_id, output)

    def shutdown(self) -> None:
        self.executor.shutdown()
