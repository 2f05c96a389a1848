"""What every route shares, held on the app by `build_app` and handed to the routes as a FastAPI
dependency, so that a handler's signature says what it uses."""
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from distengine.generation_config import SamplingDefaults
from launch.serve.errors import APIError, not_running
from launch.serve.request_log import RequestLogger


@dataclass
class ServerState:
    engine: Any  # distengine.async_llm.AsyncLLM
    served_names: list[str]  # the model's names in the API; the first one answers for a request naming none
    tokenizer: Any  # None for a model served without one (token ids in, empty texts out)
    chat_template: str | None = None  # --chat-template, else None: the tokenizer's
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # for the fields a request leaves out
    request_logger: RequestLogger | None = None  # --enable-log-requests
    tool_parser: Any = None  # the ToolParser of tool_choice "auto" (--enable-auto-tool-choice), else None

    def model_name(self, requested: str | None) -> str:
        return requested or self.served_names[0]

    def ensure_ready(self, model: str | None) -> None:
        """Raises the answer for a request naming a model we do not serve, or coming once the
        engine is dead or shutting down."""
        if model is not None and model not in self.served_names:
            raise APIError(404, f"the model '{model}' does not exist; this server serves {self.served_names}", "model")
        if self.engine.dead is not None or not self.engine.is_running:
            raise not_running(self.engine.dead or "shutting down")


async def server_state(request: Request) -> ServerState:
    # async: FastAPI would run a plain function in its thread pool, once per request.
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]  # a route's parameter `state: State`
