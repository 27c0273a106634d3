"""The docker-compose stack: specserve on a GPU, Prometheus and Grafana wired to
each other, every mounted file present, the server's arguments accepted by its CLI."""

import re

from server.settings import ServerSettings
from tests.deploy.conftest import DEPLOY, ROOT, check_server_args


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration))


def test_services(compose):
    assert set(compose["services"]) == {"specserve", "prometheus", "grafana"}
    for name in ("prometheus", "grafana"):
        image = compose["services"][name]["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d+\.\d+\.\d+", image), f"{name}: pin the image version, not {image}"


def test_specserve_gets_a_gpu(compose):
    svc = compose["services"]["specserve"]
    (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert device.get("count", "all") == "all" or int(device["count"]) >= 1


def test_specserve_builds_from_the_repository(compose):
    build = compose["services"]["specserve"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == ROOT / "Dockerfile"
    assert "8000:8000" in compose["services"]["specserve"]["ports"]


def test_specserve_arguments_are_accepted_by_the_cli(compose):
    check_server_args(compose["services"]["specserve"]["command"])


def test_models_are_mounted_read_only(compose):
    volumes = compose["services"]["specserve"]["volumes"]
    assert any(v.endswith(":/models:ro") for v in volumes), volumes


def test_stop_grace_period_covers_the_drain(compose):
    drain = ServerSettings.model_fields["shutdown_timeout"].default
    assert seconds(compose["services"]["specserve"]["stop_grace_period"]) >= drain + 5


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
