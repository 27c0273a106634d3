"""Running the app under uvicorn, with a graceful shutdown.

On SIGTERM (or Ctrl-C) ``GracefulServer`` first marks the replica unready for
``drain_delay`` seconds: ``/health`` answers 503, so that a router's health
check or a readiness probe takes it out of rotation, while requests that still
arrive are served as usual (nothing a router sent in the meantime fails). Then
uvicorn stops accepting connections and waits for the open ones, and the
serving layer drains: new requests get a 503, in-flight ones have
``shutdown_timeout`` seconds to finish, then they are aborted (streams end with
an error event and ``[DONE]``, their KV blocks are freed). Uvicorn's own
timeout, a few seconds longer, is only a backstop; the lifespan then stops the
engine.

After a drain the process exits with status 0. (Uvicorn re-raises a caught
SIGTERM once it has shut down, which would end the process "killed by
SIGTERM"; it restores the handler that was installed before it started, so
``run_server`` installs one that turns that re-raise into a normal return.)
"""

import asyncio
import logging
import math
import signal
import socket
import time

import uvicorn
from fastapi import FastAPI

from server import openmp
from server.app import create_app
from server.logs import configure_logging
from server.settings import ServerSettings

log = logging.getLogger(__name__)

BACKSTOP_S = 5  # uvicorn cancels whatever is left this long after our own deadline


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI, shutdown_timeout: float, drain_delay: float = 0.0):
        super().__init__(config)
        self.app = app
        self.shutdown_timeout = shutdown_timeout
        self.drain_delay = drain_delay

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = getattr(self.app.state, "specserve", None)
        if state is not None:
            if self.drain_delay > 0:
                state.serving.ready = False
                log.info("unready before draining", extra={"fields": {"delay_s": self.drain_delay}})
                deadline = time.monotonic() + self.drain_delay
                while time.monotonic() < deadline and not self.force_exit:  # a second Ctrl-C cuts it short
                    await asyncio.sleep(0.1)
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
    return GracefulServer(config, app, settings.shutdown_timeout, settings.drain_delay)


class _Terminated(Exception):
    """SIGTERM arrived outside uvicorn's own handling (before it started, or re-raised after its drain)."""


def _on_sigterm(signum, frame) -> None:
    raise _Terminated


def run_server(settings: ServerSettings) -> int:
    """Serve until SIGTERM / SIGINT; returns the process exit status (0 after a SIGTERM drain).
    With ``--headless`` (nodes 1 .. nnodes - 1) run this node's tensor-parallel workers instead."""
    configure_logging(settings.log_level, settings.log_format)
    log.info("CPU threading: %s", openmp.describe())
    if settings.headless:
        from engine.distributed.headless import run_headless

        return run_headless(settings.engine_config().parallel)
    server = build_server(settings)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        server.run()
    except _Terminated:
        log.info("terminated")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 3  # 3: uvicorn's "startup failed"
