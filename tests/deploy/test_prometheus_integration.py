"""A real Prometheus on loopback scrapes a live specserve server (ngram
speculation on the default model), and PromQL's speculative acceptance rate
equals the ratio of the server's own counters read from /metrics directly.

Marked ``integration``, outside the default selection: ``make test-integration``.
It runs the ``prometheus`` binary of Debian's ``prometheus`` package (``make
tools``, as root) and skips, saying so, when it is missing.
"""

import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from bench.server_procs import free_port, stop
from deploy.dashboard import ACCEPTED, DRAFTED, DRAFTS, acceptance_length, acceptance_rate
from tests.deploy.conftest import TOOLS_MISSING, tool
from tests.deploy.promql import as_promql
from tests.server.conftest import MODEL, wait_idle
from tests.server.spec_server import COPY_PROMPT, llm_engine, scrape, server, spec_engine  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

READY_TIMEOUT_S = 30
SCRAPE_WAIT_S = 30  # scrapes come every second
RELATIVE_TOLERANCE = 1e-9


@pytest.fixture(scope="session")
def prometheus_bin() -> str:
    path = tool("prometheus")
    if path is None:
        pytest.skip(TOOLS_MISSING.format(name="prometheus"))
    return path


class Prometheus:
    """A prometheus process on 127.0.0.1; ``query`` runs an instant query at now."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path):
        self.proc, self.url, self.log = proc, url, log

    def log_tail(self) -> str:
        return self.log.read_text()[-2000:]

    def get(self, path: str, **params) -> dict:
        r = httpx.get(self.url + path, params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{path} {params}: {r.status_code} {body}"
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """The instant vector of ``promql``: ``[{"metric": labels, "value": [time, "x"]}, ...]``."""
        return self.get("/api/v1/query", query=promql)["result"]

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"prometheus exited ({self.proc.returncode}):\n{self.log_tail()}"
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus not ready after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.1)


@pytest.fixture
def prometheus(prometheus_bin, server, tmp_path):
    """Prometheus scraping ``server``'s /metrics every second, its TSDB in ``tmp_path``; killed at teardown."""
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [{
            "job_name": "specserve",
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [server.url.removeprefix("http://")]}],
        }],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{free_port()}"
    log = tmp_path / "prometheus.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address={address}"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        prom = Prometheus(proc, f"http://{address}", log)
        prom.wait_ready(READY_TIMEOUT_S)
        yield prom
    finally:
        stop(proc, 10)


def counters(server) -> dict[str, float]:
    """A direct /metrics scrape: each sample name's value, summed over its label sets."""
    totals: dict[str, float] = {}
    for samples in scrape(server).values():
        for s in samples:
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    return totals


def scalar(prom: Prometheus, promql: str) -> float | None:
    """The value of a one-series instant query; None while it has no series."""
    result = prom.query(promql)
    assert len(result) <= 1, f"{promql}: more than one series: {result}"
    return float(result[0]["value"][1]) if result else None


def wait_for_scrape(prom: Prometheus, expected: dict[str, float]) -> None:
    """Until Prometheus' latest samples of these counters equal ``expected`` (a scrape after the requests)."""
    deadline = time.monotonic() + SCRAPE_WAIT_S
    while (seen := {name: scalar(prom, f"sum({name})") for name in expected}) != expected:
        if time.monotonic() > deadline:
            stored = sorted({s["metric"]["__name__"] for s in prom.query('{__name__=~"vllm:spec.*"}')})
            targets = [(t["health"], t["lastError"]) for t in prom.get("/api/v1/targets")["activeTargets"]]
            pytest.fail(
                f"no scrape with the server's counters after {SCRAPE_WAIT_S} s: Prometheus has {seen}, "
                f"/metrics {expected}; stored vllm:spec* names {stored}; targets {targets}"
            )
        time.sleep(0.2)


def test_promql_acceptance_rate_equals_the_servers_counters(server, spec_engine, prometheus):
    client = server.client()
    # greedy copying, so that ngram drafts get accepted
    client.completions.create(model=MODEL, prompt=COPY_PROMPT, max_tokens=48, temperature=0)
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": COPY_PROMPT}], max_tokens=48, temperature=0
    )
    wait_idle(spec_engine)

    direct = counters(server)
    drafted, accepted, drafts = direct[DRAFTED], direct[ACCEPTED], direct[DRAFTS]
    assert 0 < accepted <= drafted and drafts > 0, direct
    wait_for_scrape(prometheus, {DRAFTED: drafted, ACCEPTED: accepted, DRAFTS: drafts})

    rate, length = accepted / drafted, 1 + accepted / drafts
    expected = {
        # the instantaneous form of the dashboard's ratios: sum before dividing
        f"sum({ACCEPTED}) / sum({DRAFTED})": rate,
        f"1 + sum({ACCEPTED}) / sum({DRAFTS})": length,
        # the dashboard's own builders, with last_over_time for the rate or increase of its panels
        as_promql(acceptance_rate(window="1m", fn="last_over_time"), model_name=MODEL): rate,
        as_promql(acceptance_length(window="1m", fn="last_over_time"), model_name=MODEL): length,
    }
    print(f"\ncounters: drafted {drafted:g}, accepted {accepted:g}, rounds {drafts:g}")
    for promql, want in expected.items():
        (series,) = prometheus.query(promql)
        got = float(series["value"][1])
        assert got == pytest.approx(want, rel=RELATIVE_TOLERANCE), f"{promql}: Prometheus {got}, counters {want}"
        assert series["metric"].get("method", "ngram") == "ngram", series["metric"]
        print(f"{promql} = {got!r} (counters: {want!r})")
