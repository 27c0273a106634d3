"""The published OpenAPI schema says what the server really answers.

FastAPI documents a 422 for every route with a body; this server answers
validation errors with a 400 (``api.errors``), so the 422 and its schemas are
dropped and every route lists its error statuses with OpenAI's error body.
With ``--api-key`` the schema declares the bearer scheme on the routes that
need it, so clients and fuzzers know which ones do.
"""

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from api.errors import ErrorResponse
from api.protocol import ChatCompletionChunk

# Models that only appear inside a documented stream's events, so no route refers to them directly.
STREAM_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionChunk,)

_WHY = {
    400: "Invalid parameters, or a body that is not a valid JSON request",
    401: "Missing or incorrect API key (only with --api-key)",
    404: "Unknown model",
    413: "Request body larger than --max-request-body-bytes",
    500: "The engine failed on this request",
    503: "Queue full, too many requests in flight, shutting down, or the engine is not running",
    504: "The request ran past --max-request-seconds",
}


# Request examples, shown in the schema (and sent by the fuzz tests as they are and as bases).
COMPLETION_EXAMPLES = {
    "greedy": {"value": {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}},
    "stream": {
        "value": {
            "prompt": "Once upon a time",
            "max_tokens": 32,
            "temperature": 0.7,
            "seed": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    },
    "token ids, n and logprobs": {
        "value": {"prompt": [[100, 200, 300], [400, 500]], "max_tokens": 8, "n": 2, "logprobs": 2, "seed": 7}
    },
    "stop, echo, no speculation": {
        "value": {
            "prompt": "List three colors:\n1.",
            "max_tokens": 24,
            "stop": ["\n\n", "4."],
            "echo": True,
            "top_k": 40,
            "top_p": 0.9,
            "speculative_decoding": False,
        }
    },
}
CHAT_EXAMPLES = {
    "greedy": {
        "value": {
            "messages": [
                {"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": "What is the capital of France?"},
            ],
            "max_tokens": 32,
            "temperature": 0,
        }
    },
    "stream with logprobs": {
        "value": {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a prime number."}]}],
            "max_completion_tokens": 16,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": True,
            "top_logprobs": 2,
        }
    },
    "n, penalties and stop": {
        "value": {
            "messages": [{"role": "user", "content": "Write a word."}],
            "max_tokens": 8,
            "n": 2,
            "seed": 3,
            "presence_penalty": 0.5,
            "stop": ["."],
        }
    },
}


def error_responses(*statuses: int) -> dict:
    """``responses=`` entries for a route: each status with the error body."""
    return {s: {"model": ErrorResponse, "description": _WHY[s]} for s in statuses}


def install_openapi(app: FastAPI, protected: tuple[str, ...] = ()) -> None:
    """Replace ``app.openapi`` with one that drops the 422s and, when ``protected``
    (path prefixes) is not empty, declares bearer auth on those paths."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path, item in schema["paths"].items():
            for op in item.values():
                op["responses"].pop("422", None)
                if protected and path.startswith(protected):
                    op["security"] = [{"bearer": []}]
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        _, extra = models_json_schema(
            [(m, "serialization") for m in STREAM_MODELS], ref_template="#/components/schemas/{model}"
        )
        for name, definition in extra.get("$defs", {}).items():
            schemas.setdefault(name, definition)
        if protected:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
