"""The Kubernetes manifests: valid against the API schemas (strict: no unknown
fields), and consistent with each other and with the image (ports, probes,
labels, user, GPU, grace period)."""

import re

import pytest

from server.run import BACKSTOP_S
from tests.deploy.conftest import DEPLOY, K8S_VERSIONS, check_server_args, final_stage, load_yaml


def container(k8s: dict) -> dict:
    (c,) = k8s["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def test_kinds(k8s):
    assert set(k8s) == {"Deployment", "Service", "ServiceMonitor", "PersistentVolumeClaim", "Kustomization"}


def test_kustomization_lists_every_manifest(k8s):
    listed = set(k8s["Kustomization"]["resources"])
    files = {p.name for p in (DEPLOY / "k8s").glob("*.yaml") if p.name != "kustomization.yaml"}
    assert listed == files


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kind", ["Deployment", "Service", "PersistentVolumeClaim"])
def test_schema(k8s, kind, version):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")
    kubernetes_validate.validate(k8s[kind], version or kubernetes_validate.latest_version(), strict=True)


def test_service_monitor_shape(k8s):
    sm = k8s["ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    (endpoint,) = sm["spec"]["endpoints"]
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme", "honorLabels"}
    assert endpoint["path"] == "/metrics"


def test_labels_connect_deployment_service_and_monitor(k8s):
    dep, svc, sm = k8s["Deployment"], k8s["Service"], k8s["ServiceMonitor"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()


def test_ports_match(k8s):
    ports = {p["name"]: p["containerPort"] for p in container(k8s)["ports"]}
    assert ports == {"http": 8000}
    args = container(k8s)["args"]
    if "--port" in args:
        assert args[args.index("--port") + 1] == str(ports["http"])
    (svc_port,) = k8s["Service"]["spec"]["ports"]
    assert svc_port["targetPort"] in ports
    assert k8s["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == svc_port["name"]
    annotations = k8s["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["http"] and annotations["prometheus.io/path"] == "/metrics"


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_probes_hit_health(k8s, probe):
    c = container(k8s)
    get = c[probe]["httpGet"]
    assert get["path"] == "/health"
    assert get["port"] in {p["name"] for p in c["ports"]} | {p["containerPort"] for p in c["ports"]}


def test_startup_probe_allows_minutes_to_load_the_model(k8s):
    p = container(k8s)["startupProbe"]
    assert p["periodSeconds"] * p["failureThreshold"] >= 300


def test_requests_a_gpu(k8s):
    resources = container(k8s)["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
    gpus = resources["limits"]["nvidia.com/gpu"]
    assert resources["requests"].get("nvidia.com/gpu", gpus) == gpus


def test_runs_as_the_image_user(k8s):
    sc = k8s["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    image_user = [a for k, a in final_stage() if k == "USER"][-1].split(":")[0]
    assert sc["runAsNonRoot"] and sc["runAsUser"] == int(image_user)


def test_grace_period_covers_pre_stop_and_drain(k8s):
    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    pre_stop = container(k8s)["lifecycle"]["preStop"]["exec"]["command"]
    sleep = int(pre_stop[-1]) if pre_stop[0] == "sleep" else 0
    args = container(k8s)["args"]
    drain = float(args[args.index("--drain-delay") + 1]) + float(args[args.index("--shutdown-timeout") + 1])
    assert pod["terminationGracePeriodSeconds"] >= sleep + drain + BACKSTOP_S


def test_the_readiness_probe_sees_the_drain_delay(k8s):
    """Out of the Service (and the router's view) before the listener closes."""
    probe = container(k8s)["readinessProbe"]
    args = container(k8s)["args"]
    assert float(args[args.index("--drain-delay") + 1]) > probe["periodSeconds"] * probe["failureThreshold"]


def test_server_arguments_are_accepted_by_the_cli(k8s):
    check_server_args(container(k8s)["args"])


def test_models_volume_is_the_claim(k8s):
    pod = k8s["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container(k8s)["volumeMounts"]}
    models = mounts["/models"]
    assert models["readOnly"]
    assert volumes[models["name"]]["persistentVolumeClaim"]["claimName"] == k8s["PersistentVolumeClaim"]["metadata"]["name"]
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"


def test_manifests_are_plain_yaml_without_templating():
    for path in (DEPLOY / "k8s").glob("*.yaml"):
        assert not re.search(r"\{\{|\$\{", path.read_text()), f"{path.name}: no templating, kustomize patches instead"
        assert load_yaml(path)
