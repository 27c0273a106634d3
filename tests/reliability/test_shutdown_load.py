"""SIGTERM during load, on a real ``specserve serve`` process: new requests are
refused (connection refused once the listener is closed, 503 before that), every
request in flight either finishes or ends with a clean ``shutting_down`` error
event within the drain timeout, and the process exits with status 0."""

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import finish_reason, parse_sse

DRAIN_S = 4.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20), "--num-threads", "2", *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)


@pytest.mark.slow  # a real server process under load (tests/server/test_shutdown.py drains in process)
def test_sigterm_under_load_drains_and_exits_0(tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, log, "--shutdown-timeout", str(DRAIN_S))
    try:
        wait_healthy(proc, url, log)
        # Eight streams in flight: four short ones finish within the drain, four long ones cannot.
        bodies = [{"prompt": f"Story {i}:", "max_tokens": 6, "ignore_eos": True} for i in range(4)]
        bodies += [{"prompt": f"Count to {i}000:", "max_tokens": 400, "ignore_eos": True} for i in range(4)]
        results: list = [None] * len(bodies)
        started = [threading.Event() for _ in bodies]

        def run(i: int) -> None:
            with httpx.Client(base_url=url, timeout=60) as http:
                with http.stream("POST", "/v1/completions", json={**bodies[i], "stream": True}) as r:
                    lines = []
                    for line in r.iter_lines():
                        lines.append(line)
                        started[i].set()
                    results[i] = (r.status_code, parse_sse(lines))

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(bodies))]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:  # a new request: the listener is closed (refused) or, just before that, a 503
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        except httpx.TransportError:
            pass
        for t in threads:
            t.join(DRAIN_S + 30)
            assert not t.is_alive(), "a stream did not end"
        assert proc.wait(DRAIN_S + 30) == 0
        took = time.monotonic() - t_term
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert took < DRAIN_S + 10
    for i, (status, events) in enumerate(results):
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        if i < 4:
            assert finish_reason(events) == "length"
        else:
            assert events[-2]["error"]["code"] == "shutting_down" and finish_reason(events[:-2]) is None
    text = log.read_text()
    assert "draining" in text and "aborted the requests left" in text and "Traceback" not in text
