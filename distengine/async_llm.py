"""`AsyncLLM`: the engine for many clients at once, on asyncio.

The engine loop (`EngineCore.step`, the output processor) runs in its own thread, so HTTP work
never stalls a step and a step never stalls the event loop. Requests reach that thread through a
queue and join the running batch at its next step (continuous batching across clients); each
request's outputs come back through its own asyncio queue as deltas: the new text and token ids
since the last one (several steps' worth when the consumer fell behind), the last one marked
finished. A request whose consumer goes away (the client disconnected, the iterator was closed)
is aborted at once and its blocks return to the pool.

If the engine dies (a worker raised or died), every request in flight ends with `EngineDeadError`
and so does every later one.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from distengine.config import EngineConfig
from distengine.engine_core import EngineCore
from distengine.executor import EngineDeadError
from distengine.inputs import InputProcessor
from distengine.llm import eos_token_ids, load_tokenizer
from distengine.metrics import EngineMetrics, StatsLogger
from distengine.output_processor import OutputProcessor
from distengine.outputs import CompletionOutput, RequestOutput
from distengine.sampling_params import SamplingParams
from distengine.scheduler import EngineRequest
from workers.loader import load_hf_config, resolve_model_path, text_config


@dataclass
class _Stream:
    """One request's outputs, delivered from the engine thread into the request's event loop."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class _Outbox:
    """What the engine thread hands to the event loops, sent in one go: one wake-up per loop and
    step, not one per request. With hundreds of streams the wake-ups would cost the event loop more
    than the outputs themselves, and that loop shares the interpreter with the engine thread."""

    def __init__(self) -> None:
        self._items: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}

    def put(self, stream: _Stream, item) -> None:
        self._items.setdefault(stream.loop, []).append((stream.queue, item))

    def flush(self) -> None:
        items, self._items = self._items, {}
        for loop, batch in items.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


def _deliver(batch: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in batch:
        q.put_nowait(item)


def _merged(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one."""
    x, y = a.outputs[0], b.outputs[0]
    logprobs = None if x.logprobs is None and y.logprobs is None else (x.logprobs or []) + (y.logprobs or [])
    comp = CompletionOutput(index=y.index, text=x.text + y.text, token_ids=x.token_ids + y.token_ids,
                            finish_reason=y.finish_reason, stop_reason=y.stop_reason, logprobs=logprobs)
    return RequestOutput(request_id=b.request_id, prompt=b.prompt, prompt_token_ids=b.prompt_token_ids,
                         num_cached_tokens=b.num_cached_tokens, finished=b.finished, outputs=[comp])


class AsyncLLM:
    """`AsyncLLM(model, **options)`: the options are `EngineConfig`'s, as for `LLM`.
    `log_stats_interval` (seconds): log vLLM's stats line that often while there is work (logger
    `distengine.stats`, level INFO); None: no line."""

    def __init__(self, model: str, metrics_name: str | None = None, log_stats_interval: float | None = None,
                 **options) -> None:
        self.stats_logger = StatsLogger(log_stats_interval) if log_stats_interval is not None else None
        self.config = EngineConfig.create(model, **options)
        path = resolve_model_path(self.config.model)
        self.tokenizer = load_tokenizer(self.config.tokenizer or str(path))
        self.eos_token_ids = eos_token_ids(path, text_config(load_hf_config(path)))
        self.engine = EngineCore(self.config)
        self.max_model_len = self.config.max_model_len
        self.vocab_size = self.engine.executor.plan_info["vocab_size"]
        self.inputs = InputProcessor(self.tokenizer, self.vocab_size, self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics(metrics_name or self.config.model)
        self.dead: EngineDeadError | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._outbox = _Outbox()  # the engine thread's
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="distengine-engine", daemon=True)
        self._thread.start()

    # ---- the event loop's side -------------------------------------------------------------
    def check(self, prompt, sampling_params: SamplingParams) -> tuple[str | None, list[int]]:
        """The input contract for one request (raises TypeError/ValueError naming the field)."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        self.inputs.params(sampling_params, -1)
        return self.inputs.prompt(prompt, 0)

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str,
                       checked: tuple[str | None, list[int]] | None = None) -> AsyncIterator[RequestOutput]:
        """Deltas of one request's output, the last one finished. `checked` is what `check`
        returned, when the caller has already checked the prompt."""
        self._raise_if_dead()
        text, ids = checked if checked is not None else await asyncio.to_thread(self.check, prompt, sampling_params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._commands.put(("add", request_id, text, ids, sampling_params, stream, time.monotonic()))
        self._wake.set()
        finished = False
        held = None  # an error found while merging, raised after what came before it
        try:
            while not finished:
                out = held if held is not None else await stream.queue.get()
                held = None
                if isinstance(out, BaseException):
                    finished = True  # nothing of it is left in the engine
                    raise out
                # A consumer that fell behind gets what piled up as one delta (as vLLM's output
                # collector does): a slow client or a busy event loop costs one chunk, not one per step.
                while not out.finished and not stream.queue.empty():
                    more = stream.queue.get_nowait()
                    if isinstance(more, BaseException):
                        held = more
                        break
                    out = _merged(out, more)
                finished = out.finished
                yield out
        finally:
            if not finished:  # cancelled, or the consumer stopped reading: free its blocks now
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    @property
    def is_running(self) -> bool:
        return self.dead is None and not self._stopping

    def _raise_if_dead(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    async def check_health(self, timeout: float = 3.0) -> None:
        """Raises EngineDeadError unless the engine and every worker answer."""
        self._raise_if_dead()
        executor = self.engine.executor
        try:
            await asyncio.wait_for(asyncio.to_thread(executor.check_health), timeout)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"a worker did not answer a health check within {timeout:g} s") from None

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        outbox = _Outbox()
        for stream in self._streams.values():
            outbox.put(stream, EngineDeadError("the engine shut down"))
        outbox.flush()
        self._streams.clear()
        self.engine.shutdown()

    # ---- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                sched = self.engine.scheduler
                if not (sched.has_unfinished() or sched.has_in_flight()):
                    self._record_state(sched)
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                updates = self.engine.step()
                now = time.monotonic()
                finished, stops, touched = self.outputs.process(updates, now)
                for rid, matched in stops:
                    self.engine.finish_request(rid, "stop", matched)
                self.metrics.count_generated(len(touched))  # one token each: one counter update per step
                for st in touched:
                    self._record_token(st, now)
                    stream = self._streams.get(st.req_id)
                    if stream is not None:
                        self._outbox.put(stream, st.delta())
                for st in finished:
                    self.metrics.e2e.observe(now - st.arrival_time)
                    self._streams.pop(st.req_id, None)
                    self.outputs.pop(st.req_id)
                self._outbox.flush()
                self._record_state(sched)
        except BaseException as e:  # noqa: BLE001 - the engine is gone: every request must hear it
            self._fail(e)

    def _record_state(self, sched) -> None:
        self.metrics.record_state(sched)
        if self.stats_logger is not None:
            self.stats_logger.tick(time.monotonic(), self.metrics, sched)

    def _record_token(self, st, now: float) -> None:
        m = self.metrics
        if len(st.token_ids) == 1:  # its prefill is done: its prompt counts now, as in vLLM
            m.count_prompt(len(st.prompt_token_ids))
            m.ttft.observe(now - st.arrival_time)
        elif st.last_gap is not None:
            m.itl.observe(st.last_gap)

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                _, rid, text, ids, sp, stream, arrival = cmd
                try:
                    self.engine.add_request(EngineRequest(rid, ids, sampling=sp, eos_token_ids=self.eos_token_ids))
                except (ValueError, TypeError) as e:  # e.g. a request id already in use
                    self._outbox.put(stream, e)
                    continue
                self.outputs.add_request(rid, text, ids, sp, arrival)
                self._streams[rid] = stream
            else:
                rid = cmd[1]
                self.engine.abort([rid])
                self.outputs.pop(rid)
                self._streams.pop(rid, None)
        self._outbox.flush()  # refused requests hear it now, not after the next step

    def _fail(self, e: BaseException) -> None:
        self.dead = e if isinstance(e, EngineDeadError) else EngineDeadError(f"the engine loop failed: {e}", e)
        outbox = self._outbox  # with what the failed step had already put in it
        for stream in self._streams.values():
            outbox.put(stream, self.dead)
        self._streams.clear()
        while True:  # requests that arrived meanwhile
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                outbox.put(cmd[5], self.dead)
        outbox.flush()
