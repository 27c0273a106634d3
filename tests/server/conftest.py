"""Fixtures for the HTTP tests: engines around the session's default-model
weights (``default_engine`` of tests/conftest.py), a live uvicorn server on a
loopback port per module, the official ``openai`` client.

Every test ends with the no-lost-blocks check: once the engine is idle (aborts
cross threads, so it waits a little), the block pool is back to all free.
"""

import socket
import threading
import time

import httpx
import openai
import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from server.app import create_app
from server.cli import build_parser
from server.run import build_server
from server.settings import ServerSettings
from tests.conftest import DEFAULT_MAX_MODEL_LEN

MAX_MODEL_LEN = DEFAULT_MAX_MODEL_LEN  # the shared weights' rope table
NUM_BLOCKS = 160  # 2560 tokens of 16: more than two max_model_len requests
MODEL = "SmolLM2-135M-Instruct"


def build_engine(default: LLMEngine, **scheduler) -> LLMEngine:
    """An engine of its own (KV cache, scheduler) around the default model's weights."""
    config = EngineConfig(
        ModelConfig(max_model_len=MAX_MODEL_LEN), CacheConfig(num_blocks=NUM_BLOCKS), SchedulerConfig(**scheduler)
    )
    return LLMEngine(config, model=default.model, tokenizer=default.tokenizer)


@pytest.fixture(scope="session")
def llm_engine(default_engine, session_engines) -> LLMEngine:
    engine = build_engine(default_engine)
    session_engines.append(engine)
    return engine


class LiveServer:
    """A uvicorn server for ``app`` on 127.0.0.1 (an ephemeral port), in a thread.

    At most one live server per engine: two engine threads must never step one LLMEngine.
    """

    _engines_in_use: set[int] = set()

    def __init__(self, settings: ServerSettings, engine: LLMEngine):
        self.settings = settings
        self.engine = engine
        self.app = create_app(settings, engine)
        self.server = build_server(settings, self.app)
        self.server.config.log_level = "warning"
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        assert id(self.engine) not in self._engines_in_use, "this engine is already served by another LiveServer"
        self._engines_in_use.add(id(self.engine))
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 60) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "server did not stop"
        self._engines_in_use.discard(id(self.engine))

    def __exit__(self, *exc) -> None:
        if self._thread.is_alive():
            self.stop()

    @property
    def serving(self):
        return self.app.state.specserve.serving

    def client(self, api_key: str = "unused", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 120), **kw)


def settings_from(argv: list[str]) -> ServerSettings:
    """The settings ``specserve serve ARGV`` runs with."""
    args = build_parser().parse_args(["serve", *argv])
    return ServerSettings(**{k: v for k, v in vars(args).items() if k in ServerSettings.model_fields})


def settings(**overrides) -> ServerSettings:
    base = {"max_model_len": MAX_MODEL_LEN, "host": "127.0.0.1", "port": 0, "shutdown_timeout": 5.0}
    return ServerSettings(**{**base, **overrides})


@pytest.fixture(scope="module")
def server(llm_engine):
    """A module's live server with the default settings around ``llm_engine``; a module
    that needs other settings or another engine defines its own ``server``."""
    with LiveServer(settings(), llm_engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.client()


def wait_idle(engine: LLMEngine, timeout: float = 20.0) -> None:
    """Until the engine has no request and every block is free (or fail)."""
    deadline = time.monotonic() + timeout
    while engine.has_unfinished() or engine.kv_manager.num_free_blocks != engine.kv_manager.pool.num_blocks:
        if time.monotonic() > deadline:
            pytest.fail(
                f"engine not idle: {engine.scheduler.num_unfinished} requests, "
                f"{engine.kv_manager.num_free_blocks}/{engine.kv_manager.pool.num_blocks} blocks free"
            )
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def engines_idle_after_test(request):
    """After each test that ran a server: all requests gone, all KV blocks free."""
    yield
    for name in ("llm_engine", "small_engine"):
        if name in request.fixturenames:
            wait_idle(request.getfixturevalue(name))


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a streamed response, in order (``[DONE]`` included)."""
    events = []
    for line in response.iter_lines():
        if line:
            assert line.startswith("data: "), line
            events.append(line[len("data: ") :])
    return events
