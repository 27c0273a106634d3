"""The Kubernetes manifests past one replica: the router (deploy/k8s/router) and the
LeaderWorkerSet of a model split over nodes (deploy/k8s/multinode).

Built-in kinds are validated strictly against the Kubernetes API's own schemas
(``kubernetes-validate``). The LeaderWorkerSet is a custom resource: its envelope is
checked against ``LWS_SCHEMA`` below, written for this test from the fields of the
LWS v1 API (kubernetes-sigs/lws) that the manifest uses, and its two pod templates,
where nearly everything is, against the Kubernetes API's own PodTemplate schema.
"""

import copy

import jsonschema
import pytest
import yaml

from tests.deploy.conftest import DEPLOY, K8S_VERSIONS, check_server_args, flag, load_yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")

# What LWS puts in each pod's environment, as a group of two would see it.
LWS_ENV = {"$(LWS_LEADER_ADDRESS)": "specserve-multinode-0.specserve-multinode.default", "$(LWS_WORKER_INDEX)": "1"}

_INT_OR_STRING = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^\d+%?$"}]}
LWS_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["leaderWorkerTemplate"],
            "additionalProperties": False,
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "networkConfig": {"type": "object", "additionalProperties": False,
                                  "properties": {"subdomainPolicy": {"enum": ["Shared", "UniquePerReplica"]}}},
                "rolloutStrategy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"maxUnavailable": _INT_OR_STRING, "maxSurge": _INT_OR_STRING},
                        },
                    },
                },
                "leaderWorkerTemplate": {
                    "type": "object",
                    "required": ["workerTemplate"],
                    "additionalProperties": False,
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None"]},
                        "leaderTemplate": {"type": "object"},  # PodTemplateSpecs: checked by the Kubernetes schema
                        "workerTemplate": {"type": "object"},
                        "subGroupPolicy": {"type": "object", "properties": {"subGroupSize": {"type": "integer"}}},
                    },
                },
            },
        },
    },
}


def objects(folder: str) -> dict[str, dict]:
    """The objects of ``deploy/k8s/<folder>`` by kind (one of each)."""
    out = {}
    for path in sorted((DEPLOY / "k8s" / folder).glob("*.yaml")):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                assert doc["kind"] not in out, f"two {doc['kind']} objects"
                out[doc["kind"]] = doc
    return out


ROUTER = objects("router")
MULTINODE = objects("multinode")
LWS = MULTINODE["LeaderWorkerSet"]
TEMPLATES = {role: LWS["spec"]["leaderWorkerTemplate"][f"{role}Template"] for role in ("leader", "worker")}


def container(template: dict) -> dict:
    (c,) = template["spec"]["containers"]
    return c


def lws_args(role: str) -> list[str]:
    return [LWS_ENV.get(a, a) for a in container(TEMPLATES[role])["args"]]


@pytest.mark.parametrize("folder, kinds", [
    ("router", {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "Kustomization"}),
    ("multinode", {"LeaderWorkerSet", "Service", "Kustomization"}),
])
def test_kustomizations_list_every_manifest(folder, kinds):
    objs = objects(folder)
    assert set(objs) == kinds
    files = {p.name for p in (DEPLOY / "k8s" / folder).glob("*.yaml") if p.name != "kustomization.yaml"}
    assert set(objs["Kustomization"]["resources"]) == files


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kind", ["ServiceAccount", "Role", "RoleBinding", "Deployment", "Service"])
def test_router_objects_follow_the_kubernetes_schema(kind, version):
    kubernetes_validate.validate(ROUTER[kind], version or kubernetes_validate.latest_version(), strict=True)


def test_the_router_watches_the_specserve_pods_with_the_rights_it_is_given():
    base = load_yaml(DEPLOY / "k8s" / "deployment.yaml")
    pod_labels = base["spec"]["template"]["metadata"]["labels"]
    (c,) = ROUTER["Deployment"]["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    selector = dict(kv.split("=") for kv in [args[args.index("--selector") + 1]])
    assert selector.items() <= pod_labels.items()
    port = base["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert flag(args, "--service-discovery-port") == str(port)
    assert "--service-discovery" in args and flag(args, "--policy") == "cache_aware"
    assert ROUTER["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == ROUTER["ServiceAccount"]["metadata"]["name"]
    (rule,) = ROUTER["Role"]["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    assert ROUTER["RoleBinding"]["roleRef"]["name"] == ROUTER["Role"]["metadata"]["name"]
    launch = pytest.importorskip("sglang_router.launch_router", reason="pip install sglang-router (dev extra)")
    parsed = launch.parse_router_args([a.replace("$(POD_NAMESPACE)", "default") for a in args])
    assert parsed.service_discovery and parsed.selector == selector


def test_the_leaderworkerset_envelope_follows_the_lws_schema():
    jsonschema.validate(LWS, LWS_SCHEMA)


@pytest.mark.parametrize("mutate", [
    lambda o: o["spec"].update(leaderWorkerTemplates=o["spec"].pop("leaderWorkerTemplate")),
    lambda o: o["spec"]["leaderWorkerTemplate"].update(restartPolicy="Always"),
    lambda o: o["spec"]["leaderWorkerTemplate"].update(size="2"),
])
def test_the_lws_schema_catches_a_broken_envelope(mutate):
    broken = copy.deepcopy(LWS)
    mutate(broken)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, LWS_SCHEMA)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("role", ["leader", "worker"])
def test_pod_templates_follow_the_kubernetes_schema(role, version):
    pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"specserve-{role}"},
                    "template": TEMPLATES[role]}
    kubernetes_validate.validate(pod_template, version or kubernetes_validate.latest_version(), strict=True)


def test_the_kubernetes_schema_catches_a_broken_template():
    broken = copy.deepcopy(TEMPLATES["worker"])
    container(broken)["argz"] = container(broken).pop("args")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"},
                                      "template": broken}, kubernetes_validate.latest_version(), strict=True)


def test_leader_and_worker_form_one_group():
    """Parsed by the server's own CLI with LWS's environment: node 0 serves, node 1 is
    headless, both name the same group; one GPU per rank of each node."""
    from server.cli import build_parser
    from server.settings import ServerSettings

    check_server_args(lws_args("leader"))
    nodes = []
    for role in ("leader", "worker"):
        ns = build_parser().parse_args(["serve", *lws_args(role)])
        settings = ServerSettings(**{k: v for k, v in vars(ns).items() if k in ServerSettings.model_fields})
        nodes.append(settings)
        parallel = settings.engine_config().parallel
        assert int(container(TEMPLATES[role])["resources"]["limits"]["nvidia.com/gpu"]) == parallel.ranks_per_node
    leader, worker = nodes
    assert not leader.headless and worker.headless and [leader.node_rank, worker.node_rank] == [0, 1]
    for field in ("tensor_parallel_size", "nnodes", "master_addr", "master_port"):
        assert getattr(leader, field) == getattr(worker, field), field
    assert leader.nnodes == LWS["spec"]["leaderWorkerTemplate"]["size"]
    ports = {p["name"]: p["containerPort"] for p in container(TEMPLATES["leader"])["ports"]}
    assert ports["group"] == leader.master_port and ports["http"] == leader.port


def test_the_service_sends_clients_to_the_leaders_only():
    svc = MULTINODE["Service"]
    assert svc["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    labels = TEMPLATES["leader"]["metadata"]["labels"]
    assert {k: v for k, v in svc["spec"]["selector"].items() if not k.startswith("leaderworkerset")}.items() <= labels.items()
    assert LWS["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
