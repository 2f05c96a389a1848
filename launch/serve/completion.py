"""A /v1/completions or /v1/chat/completions request once its route has admitted it (a chat is
a completion of its templated prompt): every prompt checked by the engine, then the outputs,
whole or as server-sent events ending with `data: [DONE]`. A client that disconnects has its
requests aborted at once.

The response's id is the client's X-Request-Id header (else the body's `request_id`, else a new
one) behind OpenAI's prefix, as vLLM's; the engine knows each prompt by that id, its index and a
random suffix, so that two requests a client sends under one id both run."""
import asyncio
import dataclasses
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from distengine.executor import EngineDeadError, RequestError
from distengine.generation_config import SamplingDefaults
from distengine.sampling_params import SamplingParams
from launch.serve.errors import APIError, bad_input, died_message, error_body, not_running
from launch.serve.protocol import SSE_DONE, ResponseBuilder, TokenIdSpelling, sse, token_gap, usage
from launch.serve.state import ServerState
from launch.serve.tool_calls import ToolOutput


async def create_completion(state: ServerState, req, raw: Request, prompts: list, logprobs: int | None, *,
                            chat: bool, tools: ToolOutput | None = None):
    """The response to `req` (a `CompletionRequest` or `ChatCompletionRequest`) for `prompts`;
    `tools`: how a chat's choices are read for tool calls (None: plain content)."""
    name = state.model_name(req.model)
    try:
        sp, checked = await _check(state.engine, req, prompts, logprobs, state.sampling_defaults)
        if tools is not None and tools.parser.keeps_special_tokens:
            sp = dataclasses.replace(sp, skip_special_tokens=False)
        beams = req.beam_search_params(sp.max_tokens) if req.use_beam_search else None
    except (ValueError, TypeError) as e:
        if tools is not None and tools.forced and "structured_outputs" in str(e):
            raise APIError(400, f"tools: the schema of the forced tool choice: {e}", "tools") from None
        raise bad_input(e) from None
    except EngineDeadError as e:
        raise not_running(e) from None
    top = (getattr(req, "top_logprobs", None) or 0) if chat else 0
    spelling = TokenIdSpelling() if req.return_tokens_as_token_ids else state.tokenizer
    reply = ResponseBuilder.start(name, chat, spelling, top, raw.headers.get("x-request-id") or req.request_id)
    suffix = secrets.token_hex(4)
    run = _Generation(state.engine, checked, sp, reply, [f"{reply.id}-{i}-{suffix}" for i in range(len(checked))],
                      tools)
    if state.request_logger is not None:
        for rid, (text, ids) in zip(run.request_ids, checked):
            state.request_logger.log(rid, text, ids, sp)
    if beams is not None:
        return await run.beam_search(raw, beams)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(run.events(include_usage), media_type="text/event-stream")
    return await run.whole(raw, with_logprobs=logprobs is not None, echo=not chat and req.echo)


async def _check(engine, req, prompts: list, logprobs: int | None,
                 defaults: SamplingDefaults) -> tuple[SamplingParams, list]:
    """(sampling params, [(text, token ids)]) of a request, every prompt checked. Without
    max_tokens a request gets the server's default cut to the context left, else may fill it
    (the longest prompt decides), as vLLM's."""
    if not prompts:
        raise ValueError("prompt: must not be empty")
    max_tokens = req.requested_max_tokens()
    sp = req.to_sampling_params(max_tokens, logprobs, defaults)
    out = [await asyncio.to_thread(engine.check, p, sp, i) for i, p in enumerate(prompts)]
    longest = max(len(ids) for _, ids in out)
    if max_tokens is None:
        room = max(1, engine.max_model_len - longest)
        sp = req.to_sampling_params(min(room, defaults.max_tokens or room), logprobs, defaults)
    if longest + sp.max_tokens > engine.max_model_len:
        raise ValueError(f"max_tokens: this model's maximum context length is {engine.max_model_len} tokens; "
                         f"the request asks for {longest + sp.max_tokens} ({longest} in the prompt, "
                         f"{sp.max_tokens} in the completion)")
    return sp, out


async def until_disconnect(raw: Request, coro):
    """`coro`'s result, or None once the client has gone (its requests are then aborted)."""
    task = asyncio.create_task(coro)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            return None


@dataclass
class _Choice:
    """One prompt's output, gathered for a response that is not streamed."""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Generation:
    """The engine's requests for one API request, a prompt each, and the response they make."""
    engine: Any
    checked: list  # [(text, token ids)] per prompt, as `AsyncLLM.check` returns them
    sampling_params: SamplingParams
    reply: ResponseBuilder
    request_ids: list[str]  # the engine's, one per prompt
    tools: ToolOutput | None = None  # a chat's tool calls, read out of each choice's text

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.checked)

    async def outputs(self) -> AsyncIterator[tuple]:
        """(prompt index, delta) pairs of every prompt, merged as they come; the client going away
        cancels them all (their requests are aborted)."""
        sp, ids = self.sampling_params, self.request_ids
        if len(self.checked) == 1:  # no merging: each token costs the event loop less
            async for out in self.engine.generate(None, sp, ids[0], checked=self.checked[0]):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, pair) -> None:
            try:
                async for out in self.engine.generate(None, sp, ids[i], checked=pair):
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, pair)) for i, pair in enumerate(self.checked)]
        left = len(tasks)
        try:
            while left:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    left -= 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    @property
    def n(self) -> int:
        """Choices per prompt: prompt i's completion j is choice i * n + j, as OpenAI numbers them."""
        return self.sampling_params.n

    async def beam_search(self, raw: Request, params):
        """The response body of vLLM's `use_beam_search`: each prompt's n beams, best first."""
        async def run():
            return await asyncio.gather(*(self.engine.beam_search(None, params, rid, checked=pair)
                                          for rid, pair in zip(self.request_ids, self.checked)))
        results = await self._until_done(raw, run())
        if results is None:
            return Response(status_code=499)
        reply, body, generated = self.reply, [], 0
        for i, (res, (_, ids)) in enumerate(zip(results, self.checked)):
            for j, seq in enumerate(res.sequences):
                body.append(reply.choice(i * self.n + j, seq.text or "", None, seq.finish_reason, None))
                generated += len(seq.tokens) - len(ids)
        return reply.response(body, usage(self.prompt_tokens, generated, 0))

    async def _until_done(self, raw: Request, coro):
        """`coro`'s result, None if the client left first; an engine that died is a 503."""
        try:
            return await until_disconnect(raw, coro)
        except EngineDeadError as e:
            raise APIError(503, died_message(e)) from None
        except RequestError as e:
            raise APIError(500, str(e)) from None

    async def whole(self, raw: Request, with_logprobs: bool, echo: bool = False):
        """The response body once every prompt has finished; 499 if the client left first.
        `echo`: each choice starts with its prompt (and its logprobs with the prompt's)."""
        choices = [_Choice() for _ in range(len(self.checked) * self.n)]
        prompt_lps: dict[int, tuple[list, list]] = {}  # prompt index -> (its logprobs, their ranks)
        cached = 0

        async def collect() -> bool:
            nonlocal cached
            async for i, out in self.outputs():
                if out.prompt_logprobs is not None:
                    prompt_lps.setdefault(i, (out.prompt_logprobs, out.prompt_logprob_ranks))
                for c in out.outputs:
                    got = choices[i * self.n + c.index]
                    got.text += c.text
                    got.token_ids += c.token_ids
                    got.logprobs += c.logprobs or []
                    if c.finish_reason is not None:
                        got.finish_reason, got.stop_reason = c.finish_reason, c.stop_reason
                if out.finished:
                    cached += out.num_cached_tokens
            return True

        if await self._until_done(raw, collect()) is None:
            return Response(status_code=499)  # nobody is listening
        reply, body, tokenizer = self.reply, [], self.engine.tokenizer
        for k, c in enumerate(choices):
            text, ids = self.checked[k // self.n]
            lps, ranks = prompt_lps.get(k // self.n, (None, None))
            head = ""
            if echo and tokenizer is not None:
                head = text if text is not None else tokenizer.decode(ids)
            logprobs = None
            if with_logprobs:
                logprobs = reply.logprobs(c.token_ids, c.logprobs, len(head), ids[-1] if echo else None)
                if echo:
                    logprobs = reply.echoed_logprobs(ids, lps, logprobs)
            gap = token_gap(tokenizer, ids[-1], c.token_ids[0]) if echo and c.token_ids else ""
            choice = reply.choice(k, head + gap + c.text, logprobs, c.finish_reason, c.stop_reason)
            if self.tools is not None:
                message = choice["message"] = self.tools.message(c.text)
                choice["finish_reason"] = self.tools.finish_reason(c.finish_reason, bool(message["tool_calls"]))
            if self.sampling_params.prompt_logprobs is not None and lps is not None and not reply.chat:
                choice["prompt_logprobs"] = reply.prompt_logprobs(ids, lps, ranks)
            body.append(choice)
        response = reply.response(body, usage(self.prompt_tokens, sum(len(c.token_ids) for c in choices), cached))
        if reply.chat and self.sampling_params.prompt_logprobs is not None and 0 in prompt_lps:
            response["prompt_logprobs"] = reply.prompt_logprobs(self.checked[0][1], *prompt_lps[0])
        return response

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """The server-sent events of a streamed response; an engine that dies ends them with an
        error event (the status, 200, is long gone)."""
        reply, n = self.reply, len(self.checked) * self.n
        n_out, cached, started = 0, 0, set()
        # The token before each choice's next one (none before the first: the text is the output's
        # own), and text_offset over the whole choice, not one chunk.
        last: dict[int, int | None] = dict.fromkeys(range(n))
        offset = dict.fromkeys(range(n), 0)
        streams = {k: self.tools.stream() for k in range(n)} if self.tools is not None else None
        try:
            async for i, out in self.outputs():
                if out.finished:
                    cached += out.num_cached_tokens
                for c in out.outputs:
                    k = i * self.n + c.index
                    n_out += len(c.token_ids)
                    lp = None
                    if self.sampling_params.logprobs is not None and c.token_ids:
                        lp = reply.logprobs(c.token_ids, c.logprobs or [], offset[k], last[k])
                    if c.token_ids:
                        last[k] = c.token_ids[-1]
                    offset[k] += len(c.text)
                    choice = reply.delta_choice(k, c, lp, c.finish_reason is not None, first=k not in started)
                    if streams is not None and not self._tool_delta(choice, streams[k], c, first=k not in started):
                        continue
                    yield reply.chunk([choice])
                    started.add(k)
            if include_usage:
                yield reply.chunk([], usage=usage(self.prompt_tokens, n_out, cached))
        except EngineDeadError as e:
            yield sse(error_body(503, died_message(e)))
        except RequestError as e:
            yield sse(error_body(500, str(e)))
        yield SSE_DONE

    def _tool_delta(self, choice: dict, stream, output, first: bool) -> bool:
        """`choice`'s delta as the tool-call reading of its text makes it; False when it has
        nothing to send (text held back while it could be the start of a call)."""
        finished = output.finish_reason is not None
        got = stream.feed(output.text, final=finished)
        delta = {"role": "assistant"} if first else {}
        if got.content or not got.calls:
            delta["content"] = got.content
        if got.calls:
            delta["tool_calls"] = [d.body() for d in got.calls]
        choice["delta"] = delta
        if finished:
            choice["finish_reason"] = self.tools.finish_reason(output.finish_reason, stream.called)
        return first or finished or bool(got.content or got.calls or choice["logprobs"])
