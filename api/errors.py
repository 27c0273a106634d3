"""OpenAI's error body and the one exception type the serving layer raises.

Every failure a client can see has the body::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}}

``APIError`` carries the HTTP status and those four fields; the handlers that
``install_error_handlers`` registers turn it, FastAPI's validation errors (422
becomes 400), Starlette's HTTP errors (404 / 405 routes) and anything unexpected
(500, logged with its traceback) into that body.
"""

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def _default_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


class APIError(Exception):
    """A failure with an HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type or _default_type(status), param=param, code=code)
        self.headers = headers

    def body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def from_validation_error(exc: RequestValidationError, content_type: str = "application/json") -> APIError:
    """FastAPI's 422 as a 400: the first problem, with its top-level field as ``param``."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "invalid_unicode":
        return bad_request(first["msg"], param=first["ctx"]["param"], code="invalid_unicode")
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc:
        hint = "" if "json" in content_type else " (send it with Content-Type: application/json)"
        return bad_request(f"the body must be a JSON object{hint}", code="invalid_type")
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_type"
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return bad_request(f"'{'.'.join(loc)}': {first.get('msg', 'invalid value')}{more}", param=loc[0], code=code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc, request.headers.get("content-type", "")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(500, "internal server error", code="internal_error").response()
