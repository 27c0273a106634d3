"""Two specserve replicas behind the router of deploy/docker-compose.yml (sglang-router,
run with the compose file's own arguments), all on loopback:

(a) while one replica is drained (SIGTERM: --drain-delay, then --shutdown-timeout) and
    restarted, every request sent through the router is answered, and the restarted
    replica is routed to again;
(b) a shared-prefix workload gets a higher prefix-cache hit rate through cache-aware
    routing than through round-robin, counted by the replicas' own
    ``vllm:prefix_cache_*`` counters.

Marked ``integration`` (external processes: ``make test-integration``). It needs the
``sglang-router`` command (PyPI ``sglang-router``, in the dev extra) and skips without it.
"""

import os
import signal
import subprocess
import sys
import random
import threading
import uuid
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench.server_procs import free_port, scrape, stop
from tests.deploy.conftest import interpolate, tool

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

START_TIMEOUT_S = 600  # a replica loads torch and the model; slow on a busy 2-core machine
MODEL = "specserve"


def compose_flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


class Replica:
    """``specserve serve`` on a fixed loopback port; ``start`` again after it exited."""

    def __init__(self, name: str, compose_args: list[str], log_dir: Path):
        self.name, self.port, self.log_dir = name, free_port(), log_dir
        args = [interpolate(a) for a in compose_args]
        self.args = [
            "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", MODEL,
            "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20),
            "--drain-delay", compose_flag(args, "--drain-delay"),
            "--shutdown-timeout", compose_flag(args, "--shutdown-timeout"),
            "--speculative-config", compose_flag(args, "--speculative-config"),
        ]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_dir / f"{self.name}-{self.starts}.log", "w")
        cmd = [sys.executable, "-m", "server.cli", "serve", *self.args]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc.poll() is None, f"{self.name} exited: {self.log_tail()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"{self.name} did not start: {self.log_tail()}"
            time.sleep(0.5)

    def log_tail(self) -> str:
        return (self.log_dir / f"{self.name}-{self.starts}.log").read_text()[-3000:]

    def counter(self, name: str, **labels) -> float:
        want = {"model_name": MODEL, "engine": "0", **labels}.items()
        return sum(v for (n, lab), v in scrape(self.url).items() if n == name and want <= lab)


class Router:
    """The compose file's router command, pointed at ``replicas`` on loopback."""

    def __init__(self, binary: str, compose_args: list[str], replicas: list[Replica], log: Path, policy: str | None):
        args = []
        skip = False
        for a in compose_args:
            if a == "--worker-urls":
                skip = True
                continue
            if skip and not a.startswith("--"):
                continue
            skip = False
            if a.split("=")[0] in ("--host", "--port", "--prometheus-host", "--prometheus-port"):
                continue
            if policy and a.startswith("--policy="):
                a = f"--policy={policy}"
            args.append(a)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [binary, "launch", *args, "--host=127.0.0.1", f"--port={self.port}", "--prometheus-host=127.0.0.1",
               f"--prometheus-port={free_port()}", "--worker-urls", *(r.url for r in replicas)]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"router exited: {log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"router not ready: {log.read_text()[-3000:]}"
            time.sleep(0.5)

    def close(self) -> None:
        stop(self.proc, 10)


@pytest.fixture(scope="module")
def router_binary() -> str:
    path = tool("sglang-router")
    if path is None:
        pytest.skip("sglang-router is not installed: pip install sglang-router (in the dev extra)")
    return path


@pytest.fixture(scope="module")
def replicas(compose, router_binary, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("replicas")
    reps = [Replica(name, compose["services"][name]["command"], log_dir) for name in ("specserve-0", "specserve-1")]
    try:
        for r in reps:
            r.start()
        for r in reps:
            r.wait_healthy()
        yield reps
    finally:
        for r in reps:
            if r.proc is not None and r.proc.poll() is None:
                stop(r.proc, 60)


@pytest.fixture
def router(compose, router_binary, replicas, tmp_path):
    routers = []

    def start(policy: str | None = None) -> Router:
        routers.append(Router(router_binary, compose["services"]["router"]["command"], replicas, tmp_path / "router.log", policy))
        return routers[-1]

    yield start
    for r in routers:
        r.close()


def chat(client: httpx.Client, content: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, (r.status_code, r.text)
    return r.json()


# ---- (b) cache-aware against round-robin ----

TOPICS = ["the river Danube", "the history of printing", "how bees make honey"]


def documents(tag: str) -> list[str]:
    """One long shared prefix per topic; ``tag`` makes each run's prefixes new to the caches."""
    return [f"[{tag}] Background on {t}. " + " ".join(f"Fact {i} about {t}: it is noted in record {tag}-{i}." for i in range(40))
            for t in TOPICS]


def prefix_hit_rate(router: Router, replicas: list[Replica], tag: str) -> tuple[float, dict]:
    """Four rounds of one question per document, each round's requests sent at once (the
    router sees them in flight together: a new prefix goes to the less loaded replica);
    an odd number of documents, so that round-robin sends each one to both replicas.
    Returns the replicas' hits / queries over the run, and the counts per replica."""
    def totals():
        return [(r.counter("vllm:prefix_cache_hits_total"), r.counter("vllm:prefix_cache_queries_total")) for r in replicas]

    before = totals()
    docs = documents(tag)
    with httpx.Client(base_url=router.url, timeout=300) as client, ThreadPoolExecutor(len(docs)) as pool:
        for question in range(4):
            prompts = [f"{doc}\n\nQuestion {question}: summarise fact {question * 7}." for doc in docs]
            list(pool.map(lambda p: chat(client, p, 1), prompts))
    after = totals()
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    per_replica = {r.name: {"hits": a[0] - b[0], "queries": a[1] - b[1]} for r, a, b in zip(replicas, after, before)}
    return hits / queries, per_replica


def test_cache_aware_routing_beats_round_robin_on_shared_prefixes(router, replicas):
    rates = {}
    for policy in ("round_robin", "cache_aware"):
        r = router(policy)
        rates[policy], per_replica = prefix_hit_rate(r, replicas, tag=policy)
        r.close()
        print(f"\n{policy}: prefix-cache hit rate {rates[policy]:.3f} {per_replica}")
        assert all(v["queries"] > 0 for v in per_replica.values()), f"{policy} used one replica only: {per_replica}"
    assert rates["cache_aware"] > rates["round_robin"] + 0.1, rates


# ---- (a) drain and restart under load ----


WORDS = ["Amber", "Birch", "Cedar", "Dune", "Ember", "Fjord", "Grove", "Harbor", "Iris", "Juniper", "Kelp", "Lagoon"]


class Load:
    """``num_clients`` threads sending chat requests through the router until stopped."""

    def __init__(self, url: str, num_clients: int = 3):
        self.url, self.stopped = url, threading.Event()
        self.results: list[tuple[float, int, str]] = []  # (end time, status, finish_reason or error)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(num_clients)]
        for t in self.threads:
            t.start()

    def _run(self, client_id: int) -> None:
        n = 0
        with httpx.Client(base_url=self.url, timeout=300) as client:
            while not self.stopped.is_set():
                n += 1
                # A new text each time: no cached prefix ties it to a replica, so the router
                # balances by load, and the restarted replica gets its share.
                content = f"{random.choice(WORDS)} {uuid.uuid4().hex}: client {client_id}, request {n}, name a colour."
                body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": content}]}
                try:
                    r = client.post("/v1/chat/completions", json=body)
                    outcome = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else r.text
                    self.results.append((time.monotonic(), r.status_code, outcome))
                except httpx.HTTPError as e:
                    self.results.append((time.monotonic(), 0, repr(e)))

    def wait_for(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.results) < count:
            assert time.monotonic() < deadline, f"only {len(self.results)} of {count} requests answered"
            time.sleep(0.2)

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(300)


def test_every_request_is_answered_while_a_replica_drains_and_restarts(router, replicas):
    r = router()  # the compose file's policy (cache_aware)
    drained, other = replicas
    load = Load(r.url)
    try:
        load.wait_for(6, 300)
        t_term = time.monotonic()
        drained.proc.send_signal(signal.SIGTERM)
        assert drained.proc.wait(120) == 0, drained.log_tail()
        t_down = time.monotonic()
        load.wait_for(len(load.results) + 6, 300)  # served by the other replica alone
        drained.start()
        drained.wait_healthy()
        t_up = time.monotonic()
        deadline = time.monotonic() + 300
        while drained.counter("vllm:request_success_total", finished_reason="length") < 2:
            assert time.monotonic() < deadline, "the restarted replica was never routed to"
            time.sleep(0.5)
        load.wait_for(len(load.results) + 3, 300)
    finally:
        load.stop()
    statuses = [s for _, s, _ in load.results]
    during = [s for t, s, _ in load.results if t_term <= t <= t_up]
    print(f"\nrequests answered: {statuses.count(200)} of {len(statuses)}; during the drain and restart "
          f"({t_up - t_term:.0f} s, down {t_up - t_down:.0f} s): {during.count(200)} of {len(during)}; "
          f"the restarted replica served {drained.counter('vllm:request_success_total'):g}, "
          f"the other {other.counter('vllm:request_success_total'):g} in all")
    failed = [(s, o) for _, s, o in load.results if s != 200]
    assert not failed, failed
    assert all(o in ("length", "stop") for _, _, o in load.results)
    assert len(during) >= 6
