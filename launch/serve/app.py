"""`build_app`: the FastAPI application over an `AsyncLLM`: its state, error handlers, API key
check and routes."""
import hmac

from fastapi import FastAPI

import distengine
from launch.serve.errors import EXCEPTION_HANDLERS, error_response
from launch.serve.routes import router
from launch.serve.state import ServerState


def build_app(engine, served_names: list[str], api_key: str | None = None) -> FastAPI:
    """`served_names`: the model's names in the API; `api_key`: required on /v1, /tokenize and
    /detokenize when given."""
    app = FastAPI(title="distengine", version=distengine.__version__, exception_handlers=EXCEPTION_HANDLERS)
    app.state.server = ServerState(engine, served_names, engine.tokenizer)
    if api_key:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    app.include_router(router)
    return app


class ApiKeyCheck:
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
                response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
