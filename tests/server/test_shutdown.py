"""Graceful shutdown (SIGTERM's path): stop accepting, let in-flight requests finish
within the timeout, then abort them cleanly. One server per test, so this module
keeps no module-scoped server on the shared engine.
"""

import json
import signal
import subprocess
from pathlib import Path
import sys
import threading
import time

import httpx
import pytest

from bench.server_procs import free_port
from tests.server.conftest import LiveServer, settings, wait_idle

LONG = {"prompt": "Count to one thousand:", "max_tokens": 900, "ignore_eos": True, "stream": True}


def stream_in_thread(server: LiveServer, body: dict) -> tuple[threading.Thread, list, threading.Event]:
    """Streams ``body``; the returned event is set after the first chunk, the list gets all events."""
    events, started = [], threading.Event()

    def run():
        with server.http() as http, http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line[len("data: ") :])
                    started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, events, started


def test_drain_delay_reports_unready_while_it_still_serves(llm_engine):
    """With --drain-delay, SIGTERM first turns /health to 503 (a router's health check takes
    the replica out) while requests are still answered; then the listener closes."""
    with LiveServer(settings(drain_delay=3.0), llm_engine) as live, live.http() as http:
        assert http.get("/health").status_code == 200
        live.server.should_exit = True
        time.sleep(0.5)
        health = http.get("/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "shutting_down"
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        live.stop()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{live.url}/health", timeout=2)
    wait_idle(llm_engine)


@pytest.mark.parametrize("timeout,finishes", [(30.0, True), (1.5, False)], ids=["finishes", "aborted"])
def test_graceful_shutdown(llm_engine, timeout, finishes):
    """What SIGTERM triggers (uvicorn's should_exit): new connections are refused at once;
    in-flight requests finish within the timeout, or end with an error event and [DONE]
    once it passes; either way every block is freed."""
    body = {**LONG, "max_tokens": 12 if finishes else 900}
    with LiveServer(settings(shutdown_timeout=timeout), llm_engine) as live:
        thread, events, started = stream_in_thread(live, body)
        assert started.wait(30)
        live.server.should_exit = True
        time.sleep(0.5)  # uvicorn polls should_exit every 0.1 s
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{live.url}/health", timeout=2)
        live.stop()  # returns once uvicorn has shut down
        thread.join(10)
        assert not thread.is_alive()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    if finishes:
        assert last["choices"][0]["finish_reason"] == "length"
        assert sum(len(json.loads(e)["choices"]) for e in events[:-1]) == 12
    else:
        assert last["error"]["code"] == "shutting_down" and last["error"]["type"] == "server_error"
    wait_idle(llm_engine, timeout=5)


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (from /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie may wait for a pid 1 that never reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running: {[pid for pid in pids if alive(pid)]}"
        time.sleep(0.1)


def start_real_server(tmp_path, port: int, *extra: str) -> subprocess.Popen:
    """``specserve serve`` of the default model in a subprocess, healthy (or the test fails)."""
    log = open(tmp_path / "serve.log", "w")
    cmd = [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--shutdown-timeout",
        "20",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail((tmp_path / "serve.log").read_text()[-3000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)


@pytest.mark.slow  # multi-process
def test_sigterm_drains_a_real_server(tmp_path):
    """``specserve serve`` in a subprocess: SIGTERM mid-stream, the stream still ends
    normally, the process and its engine core exit."""
    port = free_port()
    proc = start_real_server(tmp_path, port)
    core = children(proc.pid)
    try:
        url = f"http://127.0.0.1:{port}"
        body = {**LONG, "max_tokens": 16}
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert proc.wait(30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    text = (tmp_path / "serve.log").read_text()
    assert "draining" in text and "Finished server process" in text
    assert core
    wait_gone(core)


@pytest.mark.slow  # multi-process
def test_the_engine_core_exits_when_its_server_is_killed(tmp_path):
    """SIGKILL leaves the server no time to stop its engine core: the core sees its pipe
    close and exits by itself, so no orphan holds the model and the cores. The core logs
    as the server does (here one JSON object per line)."""
    proc = start_real_server(tmp_path, free_port(), "--log-format", "json")
    try:
        core = [pid for pid in children(proc.pid) if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(core) == 1
        proc.kill()
        proc.wait(10)
        wait_gone(core)
    finally:
        if proc.poll() is None:
            proc.kill()
    ready = [json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines() if "engine ready" in line]
    assert ready and ready[0]["logger"] == "engine.llm_engine"


def test_dead_engine_is_503(llm_engine):
    with LiveServer(settings(), llm_engine) as live, live.http() as http:
        live.serving.engine.shutdown()  # the engine thread stops, as if it had died
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
