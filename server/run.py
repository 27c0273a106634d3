"""Running the app under uvicorn, with a graceful shutdown.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and waits for the
open ones; before that, ``GracefulServer`` tells the serving layer to drain:
new requests get a 503, in-flight ones have ``shutdown_timeout`` seconds to
finish, then they are aborted (streams end with an error event and
``[DONE]``, their KV blocks are freed). Uvicorn's own timeout, a few seconds
longer, is only a backstop; the lifespan then stops the engine.
"""

import logging
import math
import socket

import uvicorn
from fastapi import FastAPI

from server.app import create_app
from server.logs import configure_logging
from server.settings import ServerSettings

log = logging.getLogger(__name__)

BACKSTOP_S = 5  # uvicorn cancels whatever is left this long after our own deadline


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float):
        super().__init__(config)
        self.app = app
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = getattr(self.app.state, "specserve", None)
        if state is not None:
            state.serving.begin_drain(self.shutdown_timeout)
        await super().shutdown(sockets)


def build_server(settings: ServerSettings, app: FastAPI | None = None) -> GracefulServer:
    app = app or create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level=settings.log_level,
        access_log=False,  # RequestContext logs one line per request, with its id
        lifespan="on",
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout) + BACKSTOP_S,
    )
    return GracefulServer(config, app, settings.shutdown_timeout)


def run_server(settings: ServerSettings) -> int:
    """Serve until SIGTERM / SIGINT; returns the process exit status."""
    configure_logging(settings.log_level, settings.log_format)
    server = build_server(settings)
    server.run()
    return 0 if server.started else 3  # 3: uvicorn's "startup failed"
