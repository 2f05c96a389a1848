"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, whatever raised
them: our own refusals (`APIError`), a request body pydantic rejects, a route or method that does
not exist, or a bug (500)."""
import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from distengine.executor import EngineDeadError

STATUS_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """A request answered with an error: raised anywhere under a route, answered by `EXCEPTION_HANDLERS`."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": STATUS_TYPES.get(status, "Error"), "param": param, "code": status}}


class _AsciiJSON(JSONResponse):
    """An error body as ASCII JSON: whatever text an error quotes (a client's lone surrogate
    included) can be sent."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return _AsciiJSON(error_body(status, message, param), status_code=status)


def not_running(reason) -> APIError:
    """A request refused because the engine is dead or shutting down."""
    return APIError(503, f"the engine is not running: {reason}")


class ServerShutdown(EngineDeadError):
    """A request the server's shutdown cut short."""


def died_message(e: BaseException) -> str:
    return str(e) if isinstance(e, ServerShutdown) else f"the engine died while serving this request: {e}"


def bad_input(e: Exception) -> APIError:
    """The engine's refusal of a prompt or sampling parameter, as a 400 naming the field."""
    return APIError(400, str(e), param_of(str(e)))


def param_of(message: str) -> str | None:
    """The request field an engine error names (its messages start with it)."""
    head = message.split(" ", 1)[0].rstrip(":")
    if head.startswith("prompts"):
        return "prompt"
    if head.startswith("sampling_params."):
        head = head.split(".", 1)[1]
    head = head.split("[", 1)[0]
    return head if head.isidentifier() else None


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    """pydantic's first complaint, naming the field (without FastAPI's leading "body")."""
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return error_response(400, f"the request body is not valid JSON: {first.get('msg')}")
    field = ".".join(loc)
    got = f" (got {first['input']!r:.60})" if "input" in first and loc else ""
    return error_response(400, f"{field or 'body'}: {first.get('msg')}{got}", loc[0] if loc else None)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own 404 and 405 (no such route, no such method)."""
    return error_response(exc.status_code, str(exc.detail))


async def _internal(request: Request, exc: Exception) -> JSONResponse:
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


EXCEPTION_HANDLERS = {APIError: _api_error, RequestValidationError: _invalid_body,
                      StarletteHTTPException: _http_error, Exception: _internal}
