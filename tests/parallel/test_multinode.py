"""A tensor-parallel group split over two "nodes" on loopback, as two separate launches
with torchrun's conventions:

    specserve serve --tensor-parallel-size 2 --nnodes 2 --node-rank 0 --master-addr 127.0.0.1 --master-port P
    specserve serve --headless --tensor-parallel-size 2 --nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port P

Its greedy answers equal those of the same model unsplit (tp=1); when the worker of
node 1 dies in the middle of a request, that request ends with an error, the server
answers 503 (never hangs) and the headless launch exits 1; once both are launched
again it answers as before. Slow: four server processes load a tiny model.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from bench.server_procs import free_port, stop
from engine.worker.loader import load_tokenizer
from tests.parallel.checkpoints import save_random_llama, tp_engine
from tests.server.conftest import LiveServer, settings

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [100, 200, 300, 100, 200], list(range(40, 70))]
STREAM = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 230, "ignore_eos": True, "stream": True, "temperature": 0}
START_S = 300


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("tiny"))


def greedy(http: httpx.Client) -> list[str]:
    out = []
    for p in PROMPTS:
        r = http.post("/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


class Group:
    """The two launches of one 2-node group, logs in ``log_dir``."""

    def __init__(self, model: Path, log_dir: Path, tag: str):
        self.port, master = free_port(), free_port()
        common = ["--model", str(model), "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
                  "--master-port", str(master), "--max-model-len", "256", "--kv-cache-memory-bytes", str(16 << 20)]
        env = {**os.environ, "SPECSERVE_OPENMP": "gnu"}
        self.logs = [log_dir / f"{tag}-node0.log", log_dir / f"{tag}-node1.log"]
        serve = [sys.executable, "-m", "server.cli", "serve"]
        self.server = subprocess.Popen(
            [*serve, *common, "--node-rank", "0", "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=open(self.logs[0], "w"), stderr=subprocess.STDOUT, env=env,
        )
        self.headless = subprocess.Popen(
            [*serve, *common, "--node-rank", "1", "--headless"], stdout=open(self.logs[1], "w"), stderr=subprocess.STDOUT,
            env=env,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in self.logs)

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_S
        while True:
            assert self.server.poll() is None and self.headless.poll() is None, self.log_text()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, self.log_text()
            time.sleep(0.3)

    def worker_pid(self) -> int:
        """The rank-1 worker: the headless launch's spawned child (not multiprocessing's resource tracker)."""
        (worker,) = [c for c in psutil.Process(self.headless.pid).children()
                     if "spawn_main" in " ".join(c.cmdline()) and "resource_tracker" not in " ".join(c.cmdline())]
        return worker.pid

    def close(self) -> None:
        for p in (self.server, self.headless):
            if p.poll() is None:
                stop(p, 30)


def test_two_launches_answer_as_one_process_and_fail_cleanly(tiny, tmp_path):
    reference_engine = tp_engine(tiny, 1, tokenizer=load_tokenizer(tiny))
    with LiveServer(settings(max_model_len=256), reference_engine) as ref, ref.http() as http:
        expected = greedy(http)

    group = Group(tiny, tmp_path, "first")
    try:
        group.wait_healthy()
        with httpx.Client(base_url=group.url, timeout=60) as http:
            assert greedy(http) == expected
            print(f"\ntp=2 over two launches, greedy = tp=1: {expected}")
            with http.stream("POST", "/v1/completions", json=STREAM) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                os.kill(group.worker_pid(), signal.SIGKILL)
                t0 = time.monotonic()
                rest = [line for line in lines if line]  # the stream must end, not hang
            ended_s = time.monotonic() - t0
            assert rest[-1] == "data: [DONE]" and "error" in json.loads(rest[-2][len("data: ") :]), rest[-2:]
            health = http.get("/health")
            after = http.post("/v1/completions", json={**STREAM, "stream": False})
        print(f"worker killed: the in-flight stream ended with an error after {ended_s:.1f} s; "
              f"/health {health.status_code}, a new request {after.status_code} {after.json()['error']['code']}")
        assert ended_s < 15
        assert health.status_code == 503 and after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
        assert group.headless.wait(30) == 1, group.log_text()
    finally:
        group.close()

    again = Group(tiny, tmp_path, "restarted")
    try:
        again.wait_healthy()
        with httpx.Client(base_url=again.url, timeout=60) as http:
            assert greedy(http) == expected
        again.server.send_signal(signal.SIGTERM)  # a polite stop ends the headless node too
        assert again.server.wait(60) == 0 and again.headless.wait(60) == 0, again.log_text()
    finally:
        again.close()
