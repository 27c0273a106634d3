"""The FastAPI app factory: routes, error bodies, middleware, and the engine's lifetime.

``create_app(settings)`` builds an app whose lifespan starts the engine core in
its own process (``EngineCoreClient``; with ``--disable-frontend-multiprocessing``
it loads the model here and runs the engine on a thread, ``AsyncEngine``) and, on
the way out, aborts what is left and stops the engine. Tests pass a ready
``LLMEngine`` (``llm_engine=``) to share one loaded model between apps (on a
thread); its own config then wins over the settings' engine fields.
"""

import asyncio
import logging
from contextlib import asynccontextmanager
from functools import partial
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from api.errors import install_error_handlers
from api.openapi import install_openapi
from api.routes import router
from engine.async_engine import AsyncEngine
from engine.core_process import EngineCoreClient
from engine.utils.heap import freeze_startup_heap
from engine.llm_engine import LLMEngine
from server.logs import configure_logging
from server.middleware import BearerAuth, BodyLimit, RequestContext
from server.serving import ServingEngine
from server.serving_chat import ChatServing
from server.serving_completion import CompletionServing
from server.settings import ServerSettings

log = logging.getLogger(__name__)


def _version() -> str:
    try:
        return version("specserve")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class AppState:
    """What the routes reach through ``app.state.specserve``."""

    settings: ServerSettings
    serving: ServingEngine
    completions: CompletionServing
    chat: ChatServing


def create_app(settings: ServerSettings | None = None, llm_engine: LLMEngine | None = None) -> FastAPI:
    settings = settings or ServerSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        llm = None
        if llm_engine is None and not settings.disable_frontend_multiprocessing:
            log_setup = partial(configure_logging, settings.log_level, settings.log_format)  # the core logs as we do
            engine = await asyncio.to_thread(EngineCoreClient, settings.engine_config(), log_setup)
            freeze_startup_heap()
        else:
            llm = llm_engine or await asyncio.to_thread(LLMEngine, settings.engine_config())
            if llm_engine is None:
                freeze_startup_heap()
            engine = AsyncEngine(llm)
        serving = ServingEngine(engine, settings)
        spec = engine.config.speculative
        on_step = serving.metrics.attach_engine(spec.method, spec.num_speculative_tokens).on_step
        engine.stat_loggers.append(on_step)
        app.state.specserve = AppState(settings, serving, CompletionServing(serving), ChatServing(serving))
        log.info(
            "serving",
            extra={"fields": {"model": serving.model_names[0], "path": engine.model_path,
                              "max_model_len": engine.max_model_len}},
        )
        try:
            yield
        finally:
            aborted = serving.abort_all("shutdown")
            await asyncio.to_thread(engine.shutdown)
            engine.stat_loggers.remove(on_step)
            if llm is not None and llm_engine is None:  # ours to close: stops tensor-parallel workers
                await asyncio.to_thread(llm.close)
            log.info("engine stopped", extra={"fields": {"aborted": aborted}})

    app = FastAPI(title="specserve", version=_version(), lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(router)
    protected = (("/v1", "/metrics") if settings.protect_metrics else ("/v1",)) if settings.api_key else ()
    install_openapi(app, protected)
    # add_middleware puts each new one outside the previous ones.
    app.add_middleware(BodyLimit, max_bytes=settings.max_request_body_bytes)
    key = settings.api_key.get_secret_value() if settings.api_key else None
    app.add_middleware(BearerAuth, api_key=key, protect_metrics=settings.protect_metrics)
    if settings.allowed_origins:  # CORS is off unless origins are configured
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
            expose_headers=["X-Request-Id", "Retry-After"],
        )
    app.add_middleware(RequestContext, log_requests=not settings.disable_log_requests)
    return app
