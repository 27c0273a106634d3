"""A tensor-parallel worker that dies or hangs: ``/health`` and new requests get a
503 within seconds, the in-flight stream ends with an error event, every KV block
comes back, and no process is left; SIGTERM stops a real server's workers. Slow:
each test starts worker processes."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from bench.server_procs import free_port
from engine.config import ParallelConfig
from tests.conftest import check_no_lost_blocks
from tests.parallel.checkpoints import save_random_llama, tp_engine
from tests.server.conftest import LiveServer, settings

pytestmark = pytest.mark.slow

STREAM = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 230, "ignore_eos": True, "stream": True, "temperature": 0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("tiny"))


def wait_for(predicate, seconds: float) -> float:
    """Polls ``predicate`` until true; returns the seconds it took (fails after ``seconds``)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < seconds, "timed out"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_failed_worker_makes_the_server_answer_503(tiny, sig):
    parallel = ParallelConfig(tensor_parallel_size=2, collective_timeout_s=30, heartbeat_timeout_s=2)
    engine = tp_engine(tiny, 2, parallel=parallel)
    worker = engine.tp_workers.workers[0].process
    try:
        with LiveServer(settings(max_model_len=256), engine) as live, live.http(timeout=60) as http:
            assert http.get("/health").status_code == 200
            with http.stream("POST", "/v1/completions", json=STREAM) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                os.kill(worker.pid, sig)
                t0 = time.monotonic()
                rest = [line for line in lines if line]  # the stream must end, not hang
            ended_s = time.monotonic() - t0
            assert rest[-1] == "data: [DONE]"
            assert "error" in json.loads(rest[-2][len("data: ") :]), rest[-2]
            assert ended_s < 10
            assert wait_for(lambda: http.get("/health").status_code == 503, 5) < 5
            r = http.post("/v1/completions", json={**STREAM, "stream": False})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        check_no_lost_blocks(engine)
    finally:
        engine.close()
    assert not worker.is_alive()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("specserve-tp")]


def children(pid: int) -> list[int]:
    """Child processes of ``pid``, whichever of its threads started them."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def test_sigterm_stops_every_worker(tiny, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(tiny), "--tensor-parallel-size", "2",
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
           "--kv-cache-memory-bytes", str(16 << 20)]
    env = {**os.environ, "SPECSERVE_OPENMP": "gnu"}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(healthy, 180)
        workers = children(proc.pid)
        assert workers, "no worker process"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, -signal.SIGTERM)
        wait_for(lambda: not any(Path(f"/proc/{w}").exists() for w in workers), 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
