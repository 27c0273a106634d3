"""Admission (503 when the queue is full), a disconnect while queued, graceful shutdown.

An engine that runs one request at a time makes "waiting" deterministic.
"""

import json
import time
from pathlib import Path

import pytest

from api.routes import HealthStatus
from engine.attention.backends import BACKENDS
from tests.server.conftest import MAX_MODEL_LEN, LiveServer, build_engine, settings, wait_idle

LONG = {"prompt": "Count to one thousand:", "max_tokens": 900, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def small_engine(default_engine):
    return build_engine(default_engine, max_num_seqs=1)


@pytest.fixture(scope="module")
def server(small_engine):
    with LiveServer(settings(max_waiting=1), small_engine) as s:
        yield s


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def first_chunk(lines) -> dict:
    """The first chunk from ``lines`` (an ``iter_lines()`` the caller keeps: dropping a
    half-read iterator makes httpx close the connection, which is a disconnect)."""
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[len("data: ") :])
    raise AssertionError("stream ended without a chunk")


def test_full_queue_is_503_and_a_queued_disconnect_is_aborted(server, small_engine):
    with server.http() as a, server.http() as b, server.http() as c:
        with a.stream("POST", "/v1/completions", json=LONG) as running:
            lines = running.iter_lines()
            first_chunk(lines)  # A runs (the only slot)
            with b.stream("POST", "/v1/completions", json=LONG) as queued:
                assert queued.status_code == 200  # B was admitted and waits
                assert server.serving.pending == 1  # counted at once, before the engine thread sees it
                wait_for(lambda: len(small_engine.scheduler.waiting) == 1)
                r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "server_error"
            # B went away while queued: it leaves the waiting queue at once.
            wait_for(lambda: not small_engine.scheduler.waiting and server.serving.pending == 0)
            assert small_engine.scheduler.num_unfinished == 1
    wait_idle(small_engine, timeout=5)
    with server.http() as http:
        assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


def test_too_many_choices_for_the_queue_is_400(server):
    with server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def test_health_models_version(server):
    with server.http() as http:
        health = http.get("/health").json()
        assert health["status"] == "ok" and health["device"] == "cpu" and "CPU build" in health["device_reason"]
        assert set(health) == set(HealthStatus.model_fields) and health["attention_backend"] in BACKENDS
        [documented] = [line for line in DOCS.read_text().splitlines() if line.startswith("| `GET /health`")]
        assert all(f'"{key}"' in documented for key in health)  # docs/serving.md's route table
        assert http.get("/version").json()["version"]
        models = http.get("/v1/models").json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert (
        card["id"] == "SmolLM2-135M-Instruct" and card["object"] == "model" and card["max_model_len"] == MAX_MODEL_LEN
    )
