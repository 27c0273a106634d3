"""The HTTP routes: a thin router; the work is in server/serving_*.py.

The routes reach the serving objects through ``request.app.state.specserve``
(an ``AppState``, set by the app's lifespan).
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from api.errors import APIError
from api.openapi import CHAT_EXAMPLES, COMPLETION_EXAMPLES, error_responses
from api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
)

router = APIRouter()


def _sse(chunk: str) -> dict:
    """The "text/event-stream" of a streamed response, described per event: its data
    is a ``chunk`` (JSON), an error body (a failure in mid-stream) or ``[DONE]``."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk}"}, {"$ref": "#/components/schemas/ErrorResponse"}]}
    data = {
        "anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
        ]
    }
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return {"text/event-stream": {"schema": event}}


_GENERATION_ERRORS = error_responses(400, 401, 404, 413, 500, 503, 504)


class HealthStatus(BaseModel):
    status: str
    device: str  # where the engine runs, e.g. cuda:0 or cpu
    device_reason: str  # why: --device auto says what it found (engine.utils.devices)
    attention_backend: str


class VersionInfo(BaseModel):
    version: str


def _state(request: Request):
    return request.app.state.specserve


@router.post(
    "/v1/completions",
    response_model=None,
    responses={200: {"model": CompletionResponse, "content": _sse("CompletionResponse")}, **_GENERATION_ERRORS},
)
async def create_completion(
    body: Annotated[CompletionRequest, Body(openapi_examples=COMPLETION_EXAMPLES)], request: Request
) -> Response:
    return await _state(request).completions.create(body, request)


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={200: {"model": ChatCompletionResponse, "content": _sse("ChatCompletionChunk")}, **_GENERATION_ERRORS},
)
async def create_chat_completion(
    body: Annotated[ChatCompletionRequest, Body(openapi_examples=CHAT_EXAMPLES)], request: Request
) -> Response:
    return await _state(request).chat.create(body, request)


@router.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **error_responses(401)})
async def list_models(request: Request) -> JSONResponse:
    serving = _state(request).serving
    cards = [
        ModelCard(id=name, root=serving.engine.model_path, max_model_len=serving.max_model_len)
        for name in serving.model_names
    ]
    return JSONResponse(ModelList(data=cards).model_dump())


@router.get("/health", response_model=None, responses={200: {"model": HealthStatus}, **error_responses(503)})
async def health(request: Request) -> JSONResponse:
    """200 while the engine runs and the server takes requests; 503 when dead, or from
    SIGTERM on (while it drains, and during ``--drain-delay`` before)."""
    serving = _state(request).serving
    if not serving.engine.is_running:
        raise APIError(503, "the engine is not running", code="engine_dead")
    if serving.draining or not serving.ready:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    return JSONResponse({"status": "ok", **serving.engine.device_info()})


@router.get("/version", response_model=None, responses={200: {"model": VersionInfo}})
async def show_version() -> JSONResponse:
    try:
        v = version("specserve")
    except PackageNotFoundError:
        v = "unknown"
    return JSONResponse({"version": v})


@router.get(
    "/metrics",
    response_model=None,
    responses={
        200: {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **error_responses(401),
    },
)
async def metrics(request: Request) -> Response:
    body, content_type = _state(request).serving.metrics.render()
    return Response(content=body, media_type=content_type)
