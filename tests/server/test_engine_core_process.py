"""The engine core in its own process (the server's default, ``EngineCoreClient``),
behind a live server: what crosses the pipe (requests, refusals, deltas, aborts,
snapshots, step statistics) arrives as it does from the engine thread, and a
core that dies fails its streams and turns the server's answers into 503s.

One core process for the module (it loads the default model in a few seconds);
the test that kills it runs last.
"""

import json
import os
import signal
import time

import pytest

from tests.server.conftest import LiveServer, settings

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def core_server():
    # The shared test engine's model and settings (tests/conftest.py engine_config), so greedy texts compare.
    with LiveServer(settings(dtype="float32", device="cpu", num_gpu_blocks_override=160), None) as s:
        yield s


@pytest.fixture(scope="module")
def thread_server(llm_engine):
    with LiveServer(settings(), llm_engine) as s:
        yield s


def completion(server, prompt: str, **body) -> dict:
    with server.http() as http:
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def metric(server, name: str) -> float:
    with server.http() as http:
        text = http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def wait_core_idle(server, timeout: float = 20.0) -> None:
    """Until the core reports no request and no KV block in use (its snapshot, which crosses the pipe)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = server.serving.engine.snapshot
        if snap.num_running == 0 and snap.num_waiting == 0 and snap.kv_cache_usage == 0:
            return
        assert time.monotonic() < deadline, f"core not idle: {snap}"
        time.sleep(0.05)


def test_the_server_runs_its_engine_in_a_process_of_its_own(core_server, thread_server):
    client = core_server.serving.engine
    assert type(client).__name__ == "EngineCoreClient" and client._proc.pid != os.getpid()
    assert type(thread_server.serving.engine).__name__ == "AsyncEngine"


def test_greedy_texts_equal_the_engine_threads(core_server, thread_server):
    for prompt in PROMPTS:
        a, b = completion(core_server, prompt), completion(thread_server, prompt)
        assert a["choices"][0]["text"] == b["choices"][0]["text"]
        assert a["usage"] == b["usage"]


def test_n_choices_and_a_stream_cross_the_pipe(core_server):
    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "stream": True, "n": 2}
    texts = ["", ""]
    finishes = [None, None]
    with core_server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
                    finishes[c["index"]] = c["finish_reason"] or finishes[c["index"]]
    assert texts[0] == texts[1] == completion(core_server, PROMPTS[0], max_tokens=12)["choices"][0]["text"]
    assert finishes == ["length", "length"]


def test_a_refusal_crosses_as_the_engines_400(core_server):
    with core_server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5000})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "max_tokens" and "maximum context length is 1024" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": [0, 10**6], "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    wait_core_idle(core_server)


def test_a_client_that_goes_away_aborts_in_the_core_and_frees_its_blocks(core_server):
    body = {"prompt": PROMPTS[1], "max_tokens": 500, "temperature": 0, "stream": True, "ignore_eos": True}
    with core_server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
        assert core_server.serving.engine.snapshot.num_running == 1
    wait_core_idle(core_server)
    assert core_server.serving.live == {}


def test_step_statistics_reach_the_metrics(core_server):
    before = metric(core_server, "vllm:generation_tokens_total")
    steps = metric(core_server, "specserve_step_tokens_count")
    completion(core_server, PROMPTS[2], max_tokens=10)
    assert metric(core_server, "vllm:generation_tokens_total") == before + 10
    assert metric(core_server, "specserve_step_tokens_count") >= steps + 10


def test_a_failing_stat_logger_does_not_stop_serving(core_server):
    client = core_server.serving.engine
    calls = []

    def broken(stats):
        calls.append(stats)
        raise RuntimeError("a metrics fault")

    client.stat_loggers.append(broken)
    try:
        assert completion(core_server, PROMPTS[0], max_tokens=6)["usage"]["completion_tokens"] == 6
        assert completion(core_server, PROMPTS[2], max_tokens=6)["usage"]["completion_tokens"] == 6
    finally:
        client.stat_loggers.remove(broken)
    assert calls and client.is_running


def test_a_core_that_dies_fails_its_streams_and_the_server_answers_503(core_server):
    client = core_server.serving.engine
    body = {"prompt": PROMPTS[1], "max_tokens": 800, "temperature": 0, "stream": True, "ignore_eos": True}
    events = []
    with core_server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            events.append(line)
            if len(events) == 6:
                os.kill(client._proc.pid, signal.SIGKILL)
    errors = [json.loads(e[6:]) for e in events if e.startswith("data: {") and '"error"' in e]
    assert errors, events[-3:]
    deadline = time.monotonic() + 10
    while client.is_running:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with core_server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        assert http.get("/health").status_code == 503
