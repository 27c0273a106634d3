"""The HTTP routes: a thin router; the work is in server/serving_*.py.

The routes reach the serving objects through ``request.app.state.specserve``
(an ``AppState``, set by the app's lifespan).
"""

from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from api.errors import APIError
from api.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList

router = APIRouter()


def _state(request: Request):
    return request.app.state.specserve


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    return await _state(request).completions.create(body, request)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    return await _state(request).chat.create(body, request)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    serving = _state(request).serving
    cards = [
        ModelCard(id=name, root=serving.llm.model_path, max_model_len=serving.max_model_len)
        for name in serving.model_names
    ]
    return JSONResponse(ModelList(data=cards).model_dump())


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the engine runs and the server takes requests; 503 when dead or draining."""
    serving = _state(request).serving
    if not serving.engine.is_running:
        raise APIError(503, "the engine is not running", code="engine_dead")
    if serving.draining:
        raise APIError(503, "the server is shutting down", code="shutting_down")
    return JSONResponse({"status": "ok"})


@router.get("/version")
async def show_version() -> JSONResponse:
    try:
        v = version("specserve")
    except PackageNotFoundError:
        v = "unknown"
    return JSONResponse({"version": v})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = _state(request).serving.metrics.render()
    return Response(content=body, media_type=content_type)
