"""`build_app`: the FastAPI application over an `AsyncLLM`: its state, error handlers, middleware
(CORS, the client's X-Request-Id echoed, the API key check) and routes."""
import hmac

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware

import distengine
from launch.serve.errors import EXCEPTION_HANDLERS, error_response
from launch.serve.options import ServerOptions
from launch.serve.request_log import RequestLogger
from launch.serve.routes import router
from launch.serve.state import ServerState


def build_app(engine, served_names: list[str], options: ServerOptions | None = None) -> FastAPI:
    """`served_names`: the model's names in the API; `options`: the server's (none by default: no
    API key, the tokenizer's chat template, ...)."""
    o = options or ServerOptions()
    app = FastAPI(title="distengine", version=distengine.__version__, exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = ServerState(engine, served_names, engine.tokenizer, chat_template=o.chat_template,
                                   sampling_defaults=o.sampling_defaults,
                                   request_logger=RequestLogger(o.max_log_len) if o.log_requests else None,
                                   tool_parser=o.auto_tool_parser())
    # The last one added runs first: CORS answers a preflight before the key is asked for, and
    # an error of the key check still carries the request's id.
    if o.api_key:
        app.add_middleware(ApiKeyCheck, api_key=o.api_key)
    app.add_middleware(RequestIdEcho)
    app.add_middleware(CORSMiddleware, allow_origins=list(o.allowed_origins), allow_methods=list(o.allowed_methods),
                       allow_headers=list(o.allowed_headers), allow_credentials=o.allow_credentials)
    app.include_router(router)
    return app


def route_path(scope) -> str:
    """The path the routes match: uvicorn puts the root path (--root-path) before the path it got."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root + "/"):
        return path[len(root):]
    return path


class ApiKeyCheck:
    """The API key on /v1, /tokenize and /detokenize, as plain ASGI: Starlette's `@app.middleware`
    would pass every streamed chunk through a memory stream and a task switch of its own."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = route_path(scope)
        if scope["type"] == "http" and (path.startswith("/v1") or path in ("/tokenize", "/detokenize")):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestIdEcho:
    """The client's X-Request-Id header back in the response's headers, which leave before a
    stream's first chunk. Plain ASGI, as `ApiKeyCheck`."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None) \
            if scope["type"] == "http" else None
        if given is None:
            await self.app(scope, receive, send)
            return

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", given)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
