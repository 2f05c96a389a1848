"""`distengine serve`: an OpenAI-compatible server (FastAPI + uvicorn, pydantic request bodies, as
vLLM's) over `AsyncLLM`.

Endpoints: POST /v1/completions and /v1/chat/completions (server-sent events with `stream: true`,
ending with `data: [DONE]`), GET /v1/models, /health (200 while the engine lives, 503 after),
/version, /metrics (Prometheus), POST /tokenize and /detokenize. Errors have OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`: 400 for bad input (naming the field), 401 for a
missing or wrong API key, 404 for an unknown model, 503 once the engine is dead. A client that
disconnects has its request aborted at once. SIGTERM or Ctrl-C: the server stops accepting, lets
requests in flight finish (up to --shutdown-timeout seconds, then aborts them), shuts the workers
down and frees their placement group, and exits 0.
"""

import asyncio
import contextlib
import hmac
import json
import os
import signal
import threading
import time
import uuid


def add_arguments(p) -> None:
    p.add_argument("model", help="a model folder or a Hugging Face hub id")
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1, help="tensor-parallel workers")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize "
                        "(default: $DISTENGINE_API_KEY, else none)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model's name(s) in the API (default: the model argument)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder or hub id (default: the model's)")
    p.add_argument("--max-model-len", type=int, default=None, help="the longest prompt plus output")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="fraction of each GPU to use")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV cache per rank, in bytes")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests in the running batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step at most (default: 8192 on GPUs of 70 GiB or more, else 2048)")
    p.add_argument("--no-enable-prefix-caching", action="store_true", help="no prefix caching")
    p.add_argument("--mamba-checkpoint-interval", type=int, default=None,
                   help="Mamba hybrids: also keep the state every N tokens for prefix hits (default: only "
                        "at each step's last block end and where prompts diverge; 1: every block)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"], help="model dtype")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="where the workers run")
    p.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: $RAY_ADDRESS, else local)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights, no checkpoint read (benchmarks)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds requests in flight may take to finish after SIGTERM or Ctrl-C")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no stats line (throughputs, requests, KV cache usage, prefix hit rate) every "
                        "$DISTENGINE_LOG_STATS_INTERVAL seconds (default 10) while there is work")


def run(args) -> int:
    try:
        import uvicorn
    except ImportError as e:
        raise ImportError(f"distengine serve needs the server's packages: pip install 'distengine[serve]' ({e})") from e
    from distengine.async_llm import AsyncLLM
    names = args.served_model_name or [args.model]
    interval = None if args.disable_log_stats else _stats_interval()
    engine = AsyncLLM(args.model, metrics_name=names[0], log_stats_interval=interval,
                      tensor_parallel_size=args.tensor_parallel_size,
                      tokenizer=args.tokenizer, max_model_len=args.max_model_len,
                      gpu_memory_utilization=args.gpu_memory_utilization,
                      kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens,
                      enable_prefix_caching=not args.no_enable_prefix_caching, enforce_eager=args.enforce_eager,
                      mamba_checkpoint_interval=args.mamba_checkpoint_interval,
                      dtype=args.dtype, device=args.device, ray_address=args.ray_address,
                      load_format=args.load_format)
    try:
        app = build_app(engine, names, args.api_key or os.environ.get("DISTENGINE_API_KEY") or None)
        verbose = bool(os.environ.get("DISTENGINE_VERBOSE"))
        server = _uvicorn_server(uvicorn.Config(app, host=args.host, port=args.port,
                                                log_level="info" if verbose else "warning", access_log=verbose,
                                                timeout_graceful_shutdown=args.shutdown_timeout))
        print(f"distengine serve: {names[0]} on http://{args.host}:{args.port}/v1 "
              f"(max_model_len {engine.max_model_len}, TP={args.tensor_parallel_size})", flush=True)
        server.run()
    finally:
        engine.shutdown()
    return 0


def _stats_interval() -> float:
    """The stats line's period: $DISTENGINE_LOG_STATS_INTERVAL seconds (vLLM's is
    VLLM_LOG_STATS_INTERVAL), 10 by default; its lines go to stdout."""
    import logging
    import sys
    text = os.environ.get("DISTENGINE_LOG_STATS_INTERVAL", "10")
    try:
        interval = float(text)
    except ValueError:
        interval = float("nan")
    if not interval > 0:
        raise ValueError(f"DISTENGINE_LOG_STATS_INTERVAL must be a number of seconds > 0, got {text!r}")
    logger = logging.getLogger("distengine.stats")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(asctime)s distengine: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return interval


def _uvicorn_server(config):
    """uvicorn's server, except that a SIGTERM or Ctrl-C, once the graceful shutdown is done, ends
    the process normally (status 0): uvicorn would raise the signal again."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server(config)


# ---- the application ---------------------------------------------------------------------------
STATUS_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": STATUS_TYPES.get(status, "Error"), "param": param, "code": status}}


def param_of(message: str) -> str | None:
    """The request field an engine error names (its messages start with it)."""
    head = message.split(" ", 1)[0].rstrip(":")
    if head.startswith("prompts"):
        return "prompt"
    if head.startswith("sampling_params."):
        head = head.split(".", 1)[1]
    head = head.split("[", 1)[0]
    return head if head.isidentifier() else None


class _ApiKeyCheck:
    """The API key on /v1, /tokenize and /detokenize, as plain ASGI: Starlette's `@app.middleware`
    would pass every streamed chunk through a memory stream and a task switch of its own."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path in ("/tokenize", "/detokenize")):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                from fastapi.responses import JSONResponse
                body = error_body(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine, served_names: list[str], api_key: str | None = None):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    import distengine
    from distengine.executor import EngineDeadError
    from launch.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                        TokenizeRequest)

    app = FastAPI(title="distengine", version=distengine.__version__)
    tok = engine.tokenizer

    def error(status: int, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(status, message, param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return error(400, f"the request body is not valid JSON: {first.get('msg')}")
        field = ".".join(loc)
        got = f" (got {first['input']!r:.60})" if "input" in first and loc else ""
        return error(400, f"{field or 'body'}: {first.get('msg')}{got}", loc[0] if loc else None)

    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        return error(500, f"internal error: {type(exc).__name__}: {exc}")

    if api_key:
        app.add_middleware(_ApiKeyCheck, api_key=api_key)

    def refuse(model: str | None) -> JSONResponse | None:
        if model is not None and model not in served_names:
            return error(404, f"the model '{model}' does not exist; this server serves {served_names}", "model")
        if engine.dead is not None or not engine.is_running:
            return error(503, f"the engine is not running: {engine.dead or 'shutting down'}")
        return None

    async def checked_requests(req, prompts: list, logprobs: int | None):
        """(sampling params, [(text, token ids)]) of a request, every prompt checked; without
        max_tokens a request may fill the context (the longest prompt decides)."""
        if not prompts:
            raise ValueError("prompt: must not be empty")
        max_tokens = getattr(req, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = req.max_tokens
        sp = req.to_sampling_params(max_tokens, logprobs)
        out = [await asyncio.to_thread(engine.check, p, sp, i) for i, p in enumerate(prompts)]
        longest = max(len(ids) for _, ids in out)
        if max_tokens is None:
            sp = req.to_sampling_params(max(1, engine.max_model_len - longest), logprobs)
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

    def finite(x):
        return None if x is None else (-9999.0 if x != x or x < -9999.0 else min(x, 0.0))

    def token_text(t: int, prev: int | None = None) -> str:
        """The token's text as it reads after `prev` (a sentencepiece decoder drops the leading
        space of a lone token: "▁with" would read "with", not " with")."""
        if tok is None:
            return str(t)
        if prev is None:
            return tok.decode([t])
        head, both = tok.decode([prev]), tok.decode([prev, t])
        return both[len(head):] if both.startswith(head) else tok.decode([t])

    async def run_all(checked: list, sp, rid: str):
        """(request id, deltas) pairs of every prompt, merged as they come; the client going away
        cancels them all (their requests are aborted)."""
        if len(checked) == 1:  # no merging: each token costs the event loop less
            async for out in engine.generate(None, sp, f"{rid}-0", checked=checked[0]):
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, pair) -> None:
            try:
                async for out in engine.generate(None, sp, f"{rid}-{i}", checked=pair):
                    await queue.put((i, out))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                await queue.put((i, e))

        tasks = [asyncio.create_task(pump(i, pair)) for i, pair in enumerate(checked)]
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

    def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def completion_logprobs(token_ids: list[int], lps: list[dict], offset: int, prev: int | None = None) -> dict:
        prevs = [prev, *token_ids[:-1]]
        tokens = [token_text(t, p) for t, p in zip(token_ids, prevs)]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": tokens, "token_logprobs": [finite(d.get(t)) for d, t in zip(lps, token_ids)],
                "top_logprobs": [{token_text(k, p): finite(v) for k, v in d.items()} for d, p in zip(lps, prevs)],
                "text_offset": offsets}

    def chat_logprobs(token_ids: list[int], lps: list[dict], top: int, prev: int | None = None) -> dict:
        content = []
        for t, d, p in zip(token_ids, lps, [prev, *token_ids[:-1]]):
            s = token_text(t, p)
            tops = sorted(d.items(), key=lambda kv: -kv[1])[:top]
            top_texts = [(token_text(k, p), v) for k, v in tops]  # each decoded once, not per field
            content.append({"token": s, "logprob": finite(d.get(t)), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": text, "logprob": finite(v), "bytes": list(text.encode())}
                                             for text, v in top_texts]})
        return {"content": content}

    async def serve_request(req, raw: Request, prompts: list, logprobs: int | None, chat: bool):
        name = req.model or served_names[0]
        try:
            sp, checked = await checked_requests(req, prompts, logprobs)
        except (ValueError, TypeError) as e:
            return error(400, str(e), param_of(str(e)))
        except EngineDeadError as e:
            return error(503, f"the engine is not running: {e}")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        top = (getattr(req, "top_logprobs", None) or 0) if chat else 0
        prompt_tokens = sum(len(ids) for _, ids in checked)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(rid, created, name, checked, sp, chat, include_usage, top, prompt_tokens),
                                     media_type="text/event-stream")
        texts = [""] * len(checked)
        tokens: list[list[int]] = [[] for _ in checked]
        lps: list[list[dict]] = [[] for _ in checked]
        finish: list = [None] * len(checked)
        stop_reason: list = [None] * len(checked)
        cached = [0]

        async def collect() -> bool:
            async for i, out in run_all(checked, sp, rid):
                c = out.outputs[0]
                texts[i] += c.text
                tokens[i] += c.token_ids
                lps[i] += c.logprobs or []
                if out.finished:
                    finish[i], stop_reason[i] = c.finish_reason, c.stop_reason
                    cached[0] += out.num_cached_tokens
            return True

        try:
            if await until_disconnect(raw, collect()) is None:
                return Response(status_code=499)  # nobody is listening
        except EngineDeadError as e:
            return error(503, f"the engine died while serving this request: {e}")
        choices = []
        for i in range(len(checked)):
            lp = None
            if logprobs is not None:
                lp = chat_logprobs(tokens[i], lps[i], top) if chat else completion_logprobs(tokens[i], lps[i], 0)
            body = {"message": {"role": "assistant", "content": texts[i]}} if chat else {"text": texts[i]}
            choices.append({"index": i, **body, "logprobs": lp, "finish_reason": finish[i], "stop_reason": stop_reason[i]})
        return {"id": rid, "object": kind, "created": created, "model": name, "choices": choices,
                "usage": usage(prompt_tokens, sum(len(t) for t in tokens), cached[0])}

    async def stream(rid, created, name, checked, sp, chat, include_usage, top, prompt_tokens):
        kind = "chat.completion.chunk" if chat else "text_completion"
        n_out, cached, sent_role = 0, 0, set()
        # The token before each choice's next one (none before the first: the text is the output's
        # own), and text_offset over the whole choice, not one chunk.
        last: dict[int, int | None] = dict.fromkeys(range(len(checked)))
        offset = dict.fromkeys(range(len(checked)), 0)

        def chunk(choices: list, **extra) -> str:
            return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": name,
                                          "choices": choices, **extra}) + "\n\n"

        try:
            async for i, out in run_all(checked, sp, rid):
                c = out.outputs[0]
                n_out += len(c.token_ids)
                lp = None
                if sp.logprobs is not None and c.token_ids:
                    lp = chat_logprobs(c.token_ids, c.logprobs or [], top, last[i]) if chat else \
                        completion_logprobs(c.token_ids, c.logprobs or [], offset[i], last[i])
                if c.token_ids:
                    last[i] = c.token_ids[-1]
                offset[i] += len(c.text)
                if out.finished:
                    cached += out.num_cached_tokens
                reason = c.finish_reason if out.finished else None
                if chat:
                    delta = {"content": c.text}
                    if i not in sent_role:
                        sent_role.add(i)
                        delta["role"] = "assistant"
                    choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
                else:
                    choice = {"index": i, "text": c.text, "logprobs": lp, "finish_reason": reason}
                if out.finished:
                    choice["stop_reason"] = c.stop_reason
                yield chunk([choice])
            if include_usage:
                yield chunk([], usage=usage(prompt_tokens, n_out, cached))
        except EngineDeadError as e:
            yield "data: " + json.dumps(error_body(503, f"the engine died while serving this request: {e}")) + "\n\n"
        yield "data: [DONE]\n\n"

    def precheck(req) -> JSONResponse | None:
        """The answer for a request that must not run: unknown model, dead engine, unsupported."""
        refused = refuse(req.model)
        if refused is None and req.unsupported():
            field, why = req.unsupported()[0]
            refused = error(400, why, field)
        return refused

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return precheck(req) or await serve_request(req, raw, req.prompts(), req.logprobs, chat=False)

    def chat_prompt(messages, add_generation_prompt: bool = True) -> str:
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("messages: this model has no chat template: use /v1/completions")
        try:
            return tok.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages], tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateError (raise_exception), ...
            raise ValueError(f"messages: the chat template refused them: {e}") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        refused = precheck(req)
        if refused is not None:
            return refused
        try:
            prompt = await asyncio.to_thread(chat_prompt, req.messages, req.add_generation_prompt)
        except ValueError as e:
            return error(400, str(e), "messages")
        return await serve_request(req, raw, [prompt], req.num_logprobs(), chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": n, "object": "model", "created": int(time.time()),
                                            "owned_by": "distengine", "root": engine.config.model,
                                            "max_model_len": engine.max_model_len} for n in served_names]}

    @app.get("/health")
    async def health():
        try:
            await engine.check_health()
        except EngineDeadError as e:
            return error(503, f"the engine is not running: {e}")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": distengine.__version__}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    def tokenizer_refusal(model: str | None) -> JSONResponse | None:
        """The answer of /tokenize and /detokenize when they cannot run."""
        refused = refuse(model)
        if refused is None and tok is None:
            refused = error(400, "this model has no tokenizer")
        return refused

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        refused = tokenizer_refusal(req.model)
        if refused is not None:
            return refused
        try:
            if req.messages:
                text = await asyncio.to_thread(chat_prompt, req.messages)
            elif req.prompt is not None:
                text = req.prompt
            else:
                return error(400, "give 'prompt' or 'messages'", "prompt")
            ids = (await asyncio.to_thread(tok, text, add_special_tokens=req.add_special_tokens))["input_ids"]
        except (ValueError, TypeError, UnicodeError) as e:
            return error(400, str(e), "messages" if req.messages else "prompt")
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        refused = tokenizer_refusal(req.model)
        if refused is not None:
            return refused
        try:
            ids = engine.inputs.token_ids(req.tokens, "tokens")
        except (ValueError, TypeError) as e:
            return error(400, str(e), "tokens")
        return {"prompt": tok.decode(ids)}

    return app
