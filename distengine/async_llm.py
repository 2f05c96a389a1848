"""`AsyncLLM`: the engine for many clients at once, on asyncio.

The engine loop (`distengine.engine_loop`: schedule, step, sampled tokens back) runs in a process
of its own by default, else in a thread (`distengine.core_client`), so HTTP work never stalls a
step and a step never stalls the event loop. Requests reach it as messages and join the running
batch at its next step (continuous batching across clients). The front end (this object, in the
server's process) checks inputs, detokenizes, applies stop strings and keeps the metrics; each
request's outputs come back through its own asyncio queue as deltas: the new text and token ids
since the last one (several steps' worth when the consumer fell behind), the last one marked
finished. A request whose consumer goes away (the client disconnected, the iterator was closed)
is aborted at once and its blocks return to the pool.

If the engine dies (a worker raised or died, the engine process ended), every request in flight
ends with `EngineDeadError` and so does every later one; `died` is set. A request the driver could
not serve (a failure of its own, on the host) ends with `RequestError`; the others go on.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from distengine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from distengine.config import EngineConfig
from distengine.core_client import EngineClient, ProcessEngineClient, ThreadEngineClient
from distengine.engine_messages import (AbortRequest, AddRequest, EngineDied, EngineEvent, FinishRequest, IdleStats,
                                        Refused, StepOutputs)
from distengine.executor import EngineDeadError, RequestError
from distengine.inputs import InputProcessor
from distengine.hf_config import load_tokenizer_and_eos
from distengine.metrics import EngineMetrics, StatsLogger
from distengine.output_processor import OutputProcessor
from distengine.parallel_sampling import child_params, choose, fork_point, prefix_params
from distengine.outputs import CompletionOutput, RequestOutput
from distengine.sampling_params import SamplingParams
from distengine.scheduler import EngineRequest, SchedulerStats


@dataclass
class _Stream:
    """One request's outputs, delivered into the request's event loop."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    request_id: str  # the caller's


class _Outbox:
    """What a step's outputs hand to the event loops, sent in one go: one wake-up per loop and
    step, not one per request. With hundreds of streams the wake-ups would cost the event loop more
    than the outputs themselves."""

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
                         num_cached_tokens=b.num_cached_tokens, finished=b.finished, outputs=[comp],
                         prompt_logprobs=a.prompt_logprobs or b.prompt_logprobs,
                         prompt_logprob_ranks=a.prompt_logprob_ranks or b.prompt_logprob_ranks)


def engine_process_default() -> bool:
    """$DISTENGINE_ENGINE_PROCESS: 1 (the default) runs the engine loop in a process of its own, 0
    in a thread of this one."""
    text = os.environ.get("DISTENGINE_ENGINE_PROCESS", "1")
    if text not in ("0", "1"):
        raise ValueError(f"DISTENGINE_ENGINE_PROCESS must be 0 or 1, got {text!r}")
    return text == "1"


class AsyncLLM:
    """`AsyncLLM(model, **options)`: the options are `EngineConfig`'s, as for `LLM`.
    `log_stats_interval` (seconds): log vLLM's stats line that often while there is work (logger
    `distengine.stats`, level INFO); None: no line. `engine_process`: the engine loop in a process
    of its own (True) or in a thread of this one (False); None: `engine_process_default()`."""

    def __init__(self, model: str, metrics_name: str | None = None, log_stats_interval: float | None = None,
                 engine_process: bool | None = None, **options) -> None:
        self.stats_logger = StatsLogger(log_stats_interval) if log_stats_interval is not None else None
        self.config = EngineConfig.create(model, **options)
        self.tokenizer, self.eos_token_ids = load_tokenizer_and_eos(self.config)
        self.max_model_len = self.config.max_model_len
        self.outputs = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics(metrics_name or self.config.model)
        self.dead: EngineDeadError | None = None
        self.died = threading.Event()  # set once the engine is dead (a server exits on it)
        # The engine knows a request by an id of its own, never reused: a step in flight when a
        # request ended (aborted, or a stop string found here) may still carry its tokens, and they
        # must not reach a new request under the same caller's id.
        self._streams: dict[str, _Stream] = {}  # by engine id
        self._engine_ids: dict[str, str] = {}   # the caller's id -> the engine id, while it runs
        self._streams_lock = threading.Lock()
        self._serial = itertools.count()
        self._forks: dict[str, bool] = {}  # requests of several completions before these start: aborted?
        self._outbox = _Outbox()  # the message handler's
        self._stopping = False
        if engine_process is None:
            engine_process = engine_process_default()
        client = ProcessEngineClient if engine_process else ThreadEngineClient
        self.engine: EngineClient = client(self.config, self._on_message)
        self.info = self.engine.info
        self.metrics.record_cache_config(self.info.num_blocks, self.info.plan.block_size)
        self.inputs = InputProcessor(self.tokenizer, self.info.vocab_size, self.max_model_len,
                                     self.config.structured_outputs_backend)

    # ---- the event loop's side -------------------------------------------------------------
    def check(self, prompt, sampling_params: SamplingParams, index: int = 0) -> tuple[str | None, list[int]]:
        """The input contract for one request (raises TypeError/ValueError naming the field)."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        self.inputs.params(sampling_params, -1)
        return self.inputs.prompt(prompt, index)

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str,
                       checked: tuple[str | None, list[int]] | None = None) -> AsyncIterator[RequestOutput]:
        """Deltas of one request's output, the last one finished. `checked` is what `check`
        returned, when the caller has already checked the prompt. Several completions (n,
        best_of) come as deltas of each (`outputs[0].index` says which; `finished` once all
        are); with best_of > n, only the chosen n, at the end."""
        self._raise_if_dead()
        if checked is None:
            checked = await asyncio.to_thread(self.check, prompt, sampling_params)
        if sampling_params.num_children == 1:
            async for out in self._generate_one(sampling_params, request_id, checked):
                yield out
            return
        async for out in self._generate_forked(sampling_params, request_id, checked):
            yield out

    async def beam_search(self, prompt, params: BeamSearchParams, request_id: str,
                          checked: tuple[str | None, list[int]] | None = None) -> BeamSearchOutput:
        """`LLM.beam_search` for one prompt; each beam's text is its generated tokens' (EOS not
        included), as vLLM's server gives it."""
        step = params.step_params()
        if checked is None:
            checked = await asyncio.to_thread(self.check, prompt, step)
        search = BeamSearch(checked[1], params, self.eos_token_ids, self.max_model_len)
        while not search.done:
            beams = search.requests()
            outs = await asyncio.gather(*(self._final(step, f"{request_id}[beam {search.steps}.{j}]", (None, t))
                                          for j, t in enumerate(beams)))
            search.advance([o.outputs[0].logprobs[0] for o in outs])
        n = search.prompt_len

        def generated_text(tokens: list[int]) -> str | None:
            tokens = tokens[n:-1] if tokens[-1] in self.eos_token_ids and not params.ignore_eos else tokens[n:]
            return self.tokenizer.decode(tokens) if self.tokenizer is not None else None
        return search.result(generated_text)

    async def _final(self, sp: SamplingParams, request_id: str, checked) -> RequestOutput:
        """A request's whole output (its deltas merged)."""
        last = None
        async for out in self._generate_one(sp, request_id, checked):
            last = out if last is None else _merged(last, out)
        return last

    async def _generate_forked(self, sp: SamplingParams, request_id: str, checked) -> AsyncIterator[RequestOutput]:
        """`distengine.parallel_sampling`: the prompt's whole blocks once, then each completion.
        An abort before a completion has registered (`self._forks`) keeps it from starting."""
        text, ids = checked
        prefix = fork_point(len(ids), self.info.plan.block_size) if self.config.enable_prefix_caching else 0
        queue: asyncio.Queue = asyncio.Queue()
        k = sp.num_children

        def aborted(i: int) -> RequestOutput:
            return RequestOutput(request_id, text, ids, finished=True, outputs=[CompletionOutput(i, "", [], "abort")])

        async def pump(i: int) -> None:
            try:
                if self._forks[request_id]:
                    await queue.put((i, aborted(i)))
                    return
                async for out in self._generate_one(child_params(sp, i), f"{request_id}[{i}]", (text, ids)):
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, e))

        self._forks[request_id] = False
        tasks: list[asyncio.Task] = []
        whole: list[RequestOutput | None] = [None] * k
        left = k
        try:
            if prefix:
                await self._final(prefix_params(), f"{request_id}[prefix]", (None, ids[:prefix]))
            tasks = [asyncio.create_task(pump(i)) for i in range(k)]
            while left:
                i, out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                left -= out.finished
                out.request_id = request_id
                if sp.ranks_children:
                    whole[i] = out if whole[i] is None else _merged(whole[i], out)
                    continue
                out.outputs[0].index, out.finished = i, not left
                yield out
            if sp.ranks_children:
                last = whole[0]
                last.outputs = choose([w.outputs[0] for w in whole], sp)
                yield last
        finally:
            self._forks.pop(request_id, None)
            for t in tasks:
                t.cancel()

    async def _generate_one(self, sampling_params: SamplingParams, request_id: str,
                            checked: tuple[str | None, list[int]]) -> AsyncIterator[RequestOutput]:
        text, ids = checked
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), request_id)
        engine_id = f"{request_id}-{next(self._serial)}"
        with self._streams_lock:
            if request_id in self._engine_ids:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.outputs.add_request(engine_id, text, ids, sampling_params, time.monotonic(), output_id=request_id)
            self._streams[engine_id] = stream
            self._engine_ids[request_id] = engine_id
        if self.dead is not None:  # it died while this one was being registered
            self._forget(engine_id)
            raise self.dead
        self.engine.send(AddRequest(EngineRequest(engine_id, ids, sampling=sampling_params,
                                                  eos_token_ids=self.eos_token_ids)))
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
                self._abort(engine_id)

    def abort(self, request_id: str) -> None:
        """End the running request of this (the caller's) id: the task reading its `generate`
        gets a last output (finish_reason "abort"), and its blocks return to the pool; every
        completion of one of several (`[i]` after the id)."""
        with self._streams_lock:
            if request_id in self._forks:  # one of several completions, still computing its prompt
                self._forks[request_id] = True
            engine_ids = [e for rid, e in self._engine_ids.items()
                          if rid == request_id or rid.startswith(f"{request_id}[")]
        for engine_id in engine_ids:
            self._end(engine_id, "abort")

    def abort_all(self, error: BaseException) -> None:
        """End every running request with `error` (a server's shutdown that cannot wait longer)."""
        with self._streams_lock:
            engine_ids = list(self._streams)
        for engine_id in engine_ids:
            self._end(engine_id, error)

    def _end(self, engine_id: str, how: str | BaseException) -> None:
        """Deliver a request's last output ("abort") or an error to its reader, then forget it
        and abort it in the engine."""
        with self._streams_lock:
            st, stream = self.outputs.requests.get(engine_id), self._streams.get(engine_id)
            last = how
            if isinstance(how, str):
                last = None
                if st is not None and not st.finished:
                    self.outputs.abort(engine_id)
                    last = st.delta()
        if stream is not None and last is not None:
            outbox = _Outbox()
            outbox.put(stream, last)
            outbox.flush()
        self._abort(engine_id)

    def _abort(self, engine_id: str) -> None:
        if self._forget(engine_id):
            self.metrics.count_finished("abort")
            self.engine.send(AbortRequest(engine_id))

    def collective_rpc(self, method: str | Callable, args: tuple = (), ranks: list[int] | None = None) -> list:
        """`Worker.method(*args)`, or `method(worker, *args)` for a function, on the given ranks
        (default: all), between two steps."""
        self._raise_if_dead()
        return self.engine.call("collective_rpc", method, args, ranks).result()

    @property
    def is_running(self) -> bool:
        return self.dead is None and not self._stopping

    def _raise_if_dead(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    async def check_health(self, timeout: float = 3.0) -> None:
        """Raises EngineDeadError unless the engine loop and every worker answer."""
        self._raise_if_dead()
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.engine.call("check_health")), timeout)
        except asyncio.TimeoutError:
            raise EngineDeadError(f"the engine did not answer a health check within {timeout:g} s") from None

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self.engine.shutdown()
        self._end_streams(EngineDeadError("the engine shut down"))

    # ---- the engine's messages (from its thread, or from the thread reading its process) ------
    def _on_message(self, msg: EngineEvent) -> None:
        if isinstance(msg, StepOutputs):
            self._on_step(msg.updates(), msg.stats)
        elif isinstance(msg, IdleStats):
            self._record_state(msg.stats)
        elif isinstance(msg, Refused):
            stream = self._streams.get(msg.request_id)
            if self._forget(msg.request_id) and stream is not None:
                self._outbox.put(stream, msg.error)
                self._outbox.flush()
        elif isinstance(msg, EngineDied):
            self.dead = msg.error
            self.died.set()
            self._end_streams(self.dead)

    def _on_step(self, updates, stats: SchedulerStats) -> None:
        now = time.monotonic()
        step = self.outputs.process(updates, now)
        for rid, matched in step.stops:
            self.engine.send(FinishRequest(rid, matched))
        for rid in step.failed:  # failed here, on its way to the reader: the engine drops it
            self.engine.send(AbortRequest(rid))
        self.metrics.count_generated(len(step.touched))  # one token each: one counter update per step
        for st in step.touched:
            stream = self._streams.get(st.req_id)
            if st.finish_reason == "error":
                if stream is not None:
                    self._outbox.put(stream, RequestError(f"request {stream.request_id} failed: {st.stop_reason}"))
                continue
            self._record_token(st, now)
            if stream is not None:
                self._outbox.put(stream, st.delta())
        for st in step.finished:
            self.metrics.e2e.observe(now - st.arrival_time)
            self.metrics.count_finished(st.finish_reason)
            self._forget(st.req_id)
        self._outbox.flush()
        self._record_state(stats)

    def _forget(self, engine_id: str) -> bool:
        """Drop a request's stream and output state; False when it had none left."""
        with self._streams_lock:
            self.outputs.pop(engine_id)
            stream = self._streams.pop(engine_id, None)
            if stream is not None:
                del self._engine_ids[stream.request_id]
            return stream is not None

    def _end_streams(self, error: BaseException) -> None:
        with self._streams_lock:
            streams, self._streams = self._streams, {}
            self._engine_ids.clear()
            self.outputs.requests.clear()
        outbox = _Outbox()
        for stream in streams.values():
            outbox.put(stream, error)
        outbox.flush()

    def _record_state(self, stats: SchedulerStats) -> None:
        self.metrics.record_state(stats)
        if self.stats_logger is not None:
            self.stats_logger.tick(time.monotonic(), self.metrics, stats)

    def _record_token(self, st, now: float) -> None:
        m = self.metrics
        if len(st.token_ids) == 1:  # its prefill is done: its prompt counts now, as in vLLM
            m.count_prompt(len(st.prompt_token_ids))
            m.ttft.observe(now - st.arrival_time)
        elif st.last_gap is not None:
            m.itl.observe(st.last_gap)
