"""Pure ASGI middleware (no BaseHTTPMiddleware: it would buffer streams).

Outermost first: ``RequestContext`` (request id, access log line), Starlette's
``CORSMiddleware`` (only with ``--allowed-origins``), ``BearerAuth`` (401 on
/v1/* without the key), ``BodyLimit`` (413 past the limit).
"""

import hmac
import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import APIError
from server.logs import request_id_var

log = logging.getLogger("specserve.access")

_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


class RequestContext:
    """Gives each request an id (the client's ``X-Request-Id`` when it is sane), sets
    it for logging, returns it in ``X-Request-Id`` and logs one line when the response ends."""

    def __init__(self, app: ASGIApp, log_requests: bool = True):
        self.app = app
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = (_header(scope, b"x-request-id") or b"").decode("latin-1")
        rid = given if _SAFE_ID.match(given) else uuid.uuid4().hex
        token = request_id_var.set(rid)
        status, start = 500, time.monotonic()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.log_requests:
                fields = {
                    "method": scope["method"],
                    "path": scope["path"],
                    "status": status,
                    "duration_s": time.monotonic() - start,
                }
                log.info("http request", extra={"fields": fields})
            request_id_var.reset(token)


class BearerAuth:
    """With an API key set, every path under /v1 needs ``Authorization: Bearer <key>``
    (compared in constant time), and so does /metrics with ``protect_metrics``.
    The key is never logged; a refused request's log line has only its path and status."""

    def __init__(self, app: ASGIApp, api_key: str | None, protect_metrics: bool = False):
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.protect_metrics = protect_metrics

    def _protected(self, path: str) -> bool:
        return path.startswith("/v1") or (self.protect_metrics and path.startswith("/metrics"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.key is None or scope["type"] != "http" or not self._protected(scope["path"]):
            return await self.app(scope, receive, send)
        auth = _header(scope, b"authorization") or b""
        scheme, _, token = auth.partition(b" ")
        ok = hmac.compare_digest(token.strip(), self.key) and scheme.lower() == b"bearer"
        if not ok:
            error = APIError(
                401, "missing or incorrect API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
            )
            return await error.response()(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuses a body over ``max_bytes`` with a 413, by its Content-Length or, when
    chunked, as it arrives. The body is read here (bounded) and replayed to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:  # bounded: stops past max_bytes or at the end of the body
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._too_large(scope, receive, send)
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large")
        await error.response()(scope, receive, send)
