"""The published OpenAPI schema says what the server really answers.

FastAPI documents a 422 for every route with a body; this server answers
validation errors with a 400 (``api.errors``), so the 422 and its schemas are
dropped and every route lists its error statuses with OpenAI's error body.
With ``--api-key`` the schema declares the bearer scheme on the routes that
need it, so clients and fuzzers know which ones do.
"""

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.errors import ErrorResponse

_WHY = {
    400: "Invalid parameters, or a body that is not a valid JSON request",
    401: "Missing or incorrect API key (only with --api-key)",
    404: "Unknown model",
    413: "Request body larger than --max-request-body-bytes",
    500: "The engine failed on this request",
    503: "Queue full, too many requests in flight, shutting down, or the engine is not running",
    504: "The request ran past --max-request-seconds",
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
        for name in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(name, None)
        if protected:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
