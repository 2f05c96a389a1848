"""The endpoints: POST /v1/completions and /v1/chat/completions, GET /v1/models, /health,
/version, /metrics (Prometheus), POST /tokenize and /detokenize. Each handler takes the server's
state as a dependency and answers a refusal by raising `APIError`."""
import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

import distengine
from distengine.executor import EngineDeadError
from launch.serve.completion import create_completion
from launch.serve.errors import APIError, not_running
from launch.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                   chat_prompt)
from launch.serve.state import ServerState, State
from launch.serve.tool_calls import tool_output

router = APIRouter()


def _admit(state: ServerState, req) -> None:
    """Refuses a request that must not run: unknown model, dead engine, a feature we lack."""
    state.ensure_ready(req.model)
    unsupported = req.unsupported()
    if unsupported:
        field, why = unsupported[0]
        raise APIError(400, why, field)


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request, state: State):
    _admit(state, req)
    return await create_completion(state, req, raw, req.prompts(), req.logprobs, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, raw: Request, state: State):
    _admit(state, req)
    try:
        tools = tool_output(req.tool_choice_value(), req.tool_dicts(), req.parallel_tool_calls is not False,
                            state.tool_parser)
    except ValueError as e:
        raise APIError(400, str(e), "tool_choice") from None
    try:
        prompt = await asyncio.to_thread(chat_prompt, state.tokenizer, req.messages, req.add_generation_prompt,
                                         state.chat_template, req.chat_template_kwargs, req.tool_dicts())
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(":", 1)[0] if str(e).startswith("chat_template_kwargs")
                       else "messages") from None
    return await create_completion(state, req, raw, [prompt], req.num_logprobs(), chat=True, tools=tools)


@router.get("/v1/models")
async def models(state: State):
    engine = state.engine
    return {"object": "list", "data": [{"id": n, "object": "model", "created": int(time.time()),
                                        "owned_by": "distengine", "root": engine.config.model,
                                        "max_model_len": engine.max_model_len} for n in state.served_names]}


@router.get("/health")
async def health(state: State):
    try:
        await state.engine.check_health()
    except EngineDeadError as e:
        raise not_running(e) from None
    return Response(status_code=200)


@router.get("/version")
async def version():
    return {"version": distengine.__version__}


@router.get("/metrics")
async def metrics(state: State):
    from prometheus_client import CONTENT_TYPE_LATEST  # only /metrics needs it
    return Response(state.engine.metrics.text(), media_type=CONTENT_TYPE_LATEST)


def _tokenizer_ready(state: ServerState, model: str | None) -> None:
    """Refuses /tokenize and /detokenize when they cannot run."""
    state.ensure_ready(model)
    if state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, state: State):
    _tokenizer_ready(state, req.model)
    tok = state.tokenizer
    try:
        if req.messages:
            text = await asyncio.to_thread(chat_prompt, tok, req.messages, True, state.chat_template, None,
                                           [t.for_template() for t in req.tools] if req.tools else None)
        elif req.prompt is not None:
            text = req.prompt
        else:
            raise APIError(400, "give 'prompt' or 'messages'", "prompt")
        ids = (await asyncio.to_thread(tok, text, add_special_tokens=req.add_special_tokens))["input_ids"]
    except (ValueError, TypeError, UnicodeError) as e:
        raise APIError(400, str(e), "messages" if req.messages else "prompt") from None
    return {"count": len(ids), "max_model_len": state.engine.max_model_len, "tokens": ids}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, state: State):
    _tokenizer_ready(state, req.model)
    try:
        ids = state.engine.inputs.token_ids(req.tokens, "tokens")
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e), "tokens") from None
    return {"prompt": state.tokenizer.decode(ids)}
