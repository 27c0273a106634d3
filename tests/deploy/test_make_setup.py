"""`make setup`'s install step, run with a stand-in Python that records what it is asked:
on a GPU node (nvidia-smi on PATH) it installs the image's torch from the image's index and
the flash-attn wheel the image takes; elsewhere the CPU torch from local disk."""

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from tests.deploy.test_dockerfile import build_args

ROOT = Path(__file__).resolve().parents[2]


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _install(tmp_path: Path, gpu: bool) -> list[str]:
    """The commands the recipe of ``$(VENV)/.installed`` gives the venv's Python, one a line."""
    venv, tools, log = tmp_path / "venv", tmp_path / "tools", tmp_path / "log"
    (venv / "bin").mkdir(parents=True)
    tools.mkdir()
    # the stand-in: records its arguments; asked for the wheel's URL, prints a name for it
    _script(venv / "bin" / "python", f'echo "$*" >> {log}\n'
                                     'case "$1" in deploy/flash_attn_wheel.py) echo WHEEL-FOR-"$2";; esac\n')
    if gpu:
        _script(tools / "nvidia-smi", "exit 0\n")
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"}
    subprocess.run(["make", "-s", f"VENV={venv}", f"{venv}/.installed"], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=60)
    return log.read_text().splitlines()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_gpu_node_installs_the_images_torch_and_flash_attn(tmp_path):
    args = build_args()
    calls = _install(tmp_path, gpu=True)
    assert calls[0] == f"-m pip install -q --index-url {args['TORCH_INDEX_URL']} torch=={args['TORCH_VERSION']}"
    assert calls[1] == f"deploy/flash_attn_wheel.py {args['FLASH_ATTN_VERSION']}"
    assert calls[2] == f"-m pip install -q --no-deps WHEEL-FOR-{args['FLASH_ATTN_VERSION']}"
    assert calls[3] == "-m pip install -q -e .[dev]"


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("nvidia-smi") is not None,
                    reason="needs make, and a machine without nvidia-smi")
def test_a_cpu_machine_installs_the_cpu_torch(tmp_path):
    calls = _install(tmp_path, gpu=False)
    assert calls == ["-m pip install -q torch==2.13.0", "-m pip install -q -e .[dev]"]
