"""The engine loop as its own piece: schedule, execute, update, one step at a time. `LLM` drives
it for offline generation; a server drives the same loop.

With `async_scheduling` (the default) the loop overlaps host and device: the scheduler prepares
step N+1 while the workers run step N. Each call to `step()` schedules one step, launches it, and
receives the output of the step launched before it, whose tokens it applies (see the scheduler's
docstring for how a step can be scheduled before the previous one's tokens are known). Without
it, each step's output is applied before the next one is scheduled.

Structured outputs keep the overlap as vLLM's split of a step into forward and sampling does: a
step with grammar rows goes out with `masks_follow`; the workers run its forward and wait. Once
the step before it has returned its tokens and the matchers have taken them, the host fills that
step's masks while its forward runs, and sends them with the next step's plan; the workers sample
with them, then launch the next forward.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from distengine.config import EngineConfig
from distengine.config_snapshot import snapshot
from distengine.executor import Executor, create_executor
from distengine.hf_config import load_tokenizer_and_eos, read_model_config, text_config
from distengine.interrupts import interrupts_held
from distengine.kv_cache.plan import KVCachePlan
from distengine.kv_cache.sizing import engine_plan, num_blocks
from distengine.scheduler import EngineRequest, RequestUpdate, Scheduler, SchedulerStats
from distengine.step import StepEncodingError
from distengine.structured_outputs import GrammarCompiler
from distengine.worker_info import DeviceInfo, MemoryProfile


@dataclass(frozen=True)
class EngineInfo:
    """What an engine decided at start-up and what its workers reported: for front ends (the
    vocabulary their inputs are checked against) and benchmarks (the device, the weights' bytes)."""
    config: EngineConfig            # as resolved: device, dtype, token budget
    plan: KVCachePlan
    num_blocks: int                 # per rank, the null block included
    vocab_size: int
    devices: list[DeviceInfo]       # per rank
    memory: list[MemoryProfile]     # per rank

    @property
    def uses_cuda_graphs(self) -> bool:
        return self.devices[0].is_cuda and not self.config.enforce_eager


def start_workers(config: EngineConfig, executor: Executor) -> EngineInfo:
    """The decisions of start-up, once, on the driver, between the workers' steps: the token
    budget for their devices, the plan, their model shards loaded, the blocks every rank holds
    from the memory each measured, the cache allocated."""
    config = config.placed(executor.gpus_available).with_token_budget(executor.devices)
    hf_config = read_model_config(config.model)
    text = text_config(hf_config)
    plan = engine_plan(config, text.to_dict())
    memory = executor.load(config, plan, snapshot(hf_config))
    blocks = num_blocks(config, plan, memory, executor.devices[0].is_cuda)
    executor.allocate_kv_cache(blocks)
    return EngineInfo(config, plan, blocks, int(text.vocab_size), executor.devices, memory)


@dataclass(frozen=True)
class StepRecord:
    """One step as the benchmarks time it."""
    end_time: float  # perf_counter() once launched
    num_seqs: int
    num_tokens: int
    decode_only: bool
    mask_fill_s: float = 0.0  # the host's time filling grammar masks in this step (for the step before it, overlapped)


class EngineCore:
    """Owns the scheduler and the executor: starts the workers (`start_workers`), then runs the
    loop one `step()` at a time."""

    def __init__(self, config: EngineConfig, executor: Executor | None = None, info: EngineInfo | None = None) -> None:
        """`info`: what was decided already (a test's fake executor and its own plan)."""
        self.executor = executor or create_executor(config)
        if info is None:
            try:
                info = start_workers(config, self.executor)
            except BaseException:
                self.executor.shutdown()
                raise
        self.info, self.config, self.plan = info, info.config, info.plan
        self.scheduler = Scheduler(info.plan, info.num_blocks, info.config.max_num_seqs,
                                   info.config.max_num_batched_tokens, info.config.enable_prefix_caching)
        self.step_log: list[StepRecord] | None = None  # benchmarks set a list here
        self._grammars: GrammarCompiler | None = None  # structured outputs, from the first request that asks
        self._masks_due: int | None = None  # a step launched with masks_follow: its masks go with the next plan

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        """A request with structured outputs gets its matcher here, where the scheduler runs (a
        spec its library cannot compile against the tokenizer is a ValueError naming both)."""
        spec = req.sampling.structured_outputs
        if spec is not None:
            if self._grammars is None:
                tokenizer, eos = load_tokenizer_and_eos(self.config)
                self._grammars = GrammarCompiler(tokenizer, self.info.vocab_size, eos,
                                                 self.config.structured_outputs_backend)
            req.grammar = self._grammars.matcher(spec, req.sampling.stop_token_ids)
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
        """One step: what the requests got from the step whose output arrived now. A Ctrl-C
        during it is raised once it is over (`distengine.interrupts`)."""
        with interrupts_held():
            return self._step()

    def _step(self) -> list[RequestUpdate]:
        sched = self.scheduler
        # The step launched last is running its forward; every token before it has been applied.
        t0 = time.perf_counter()
        masks = sched.grammar_masks(self._masks_due) if self._masks_due is not None else None
        fill_s = time.perf_counter() - t0 if masks is not None else 0.0
        self._masks_due = None
        plan = sched.schedule()
        plan.defer_output = self.config.async_scheduling
        plan.grammar_masks = masks
        if sched.has_grammar_rows(plan.step_id):
            if plan.defer_output:
                plan.masks_follow = True
            else:
                t0 = time.perf_counter()
                plan.grammar_masks = sched.grammar_masks(plan.step_id)
                fill_s = time.perf_counter() - t0
        if not plan.scheduled and not plan.finished_req_ids and not sched.has_in_flight():
            if sched.waiting and not sched.running:
                head = sched.waiting[0]
                sched.fail(head, f"request {head.request_id} ({head.num_tokens} tokens) cannot fit in the KV "
                                 f"cache ({sched.manager.pool.num_blocks - 1} blocks)")
            return sched.take_failed()
        try:
            output = self.executor.execute(plan)
        except StepEncodingError as e:  # nothing reached a worker: fail those requests, send the rest
            if not e.req_ids:
                raise
            sched.drop_from_step(plan, e.req_ids, e)
            plan.masks_follow = plan.masks_follow and any(s.sample for s in plan.scheduled)
            output = self.executor.execute(plan)
        if plan.masks_follow:
            self._masks_due = plan.step_id
        if self.step_log is not None and plan.scheduled:
            self.step_log.append(StepRecord(time.perf_counter(), len(plan.scheduled), plan.num_tokens,
                                            plan.num_tokens == len(plan.scheduled), fill_s))
        if output is None:
            sched.forget_lost_steps(plan.step_id)  # the workers had nothing pending: no earlier output comes
            return sched.take_failed()
        updates = sched.update(output.step_id, output)
        return sched.take_failed() + updates

    def shutdown(self) -> None:
        self.executor.shutdown()
