"""flash-attn's real Python interface, fetched at test time, over our checking stand-in.

flash-attn 2.8.3's source distribution comes from PyPI through pip (once; kept under
``engine.worker.model_store.cache_dir()``), and its ``flash_attn/__init__.py``,
``flash_attn_interface.py`` and fused ops (``FILES``) are imported unmodified, with
``flash_attn_2_cuda`` (the compiled module they import) being
``tests.gpu_fake.flash_attn_standin`` and their Triton and jiterator kernel launches
``tests.gpu_fake.flash_ops_standin``'s. Nothing of flash-attn is committed here. Without
network the tests that need it skip, saying so.
"""

import contextlib
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path
from unittest import mock

import pytest

from engine.worker.model_store import cache_dir

VERSION = "2.8.3"
FILES = ("flash_attn/__init__.py", "flash_attn/flash_attn_interface.py", "flash_attn/ops/__init__.py",
         "flash_attn/ops/activations.py", "flash_attn/ops/triton/__init__.py", "flash_attn/ops/triton/layer_norm.py",
         "flash_attn/ops/triton/rotary.py", "flash_attn/utils/__init__.py", "flash_attn/utils/library.py",
         "flash_attn/utils/torch.py")


def interface_dir() -> Path:
    """A folder holding flash-attn's ``flash_attn`` package (the two files above), fetched once."""
    root = cache_dir() / f"flash-attn-{VERSION}"
    if all((root / f).exists() for f in FILES):
        return root
    sdist = _download(root)
    with tarfile.open(sdist) as tar:
        for name in FILES:
            member = tar.getmember(f"flash_attn-{VERSION}/{name}")
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(tar.extractfile(member).read())
    return root


def _download(root: Path) -> Path:
    found = sorted(root.glob(f"flash_attn-{VERSION}.tar.gz"))
    if found:
        return found[0]
    if not _pypi_reachable():
        pytest.skip(f"flash-attn {VERSION}'s source distribution is not cached and pypi.org is unreachable (offline)")
    root.mkdir(parents=True, exist_ok=True)
    # Its setup.py runs to read the metadata; told to skip the CUDA build, it needs no nvcc.
    env = dict(os.environ, FLASH_ATTENTION_SKIP_CUDA_BUILD="TRUE")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
           "--quiet", "-d", str(root), f"flash-attn=={VERSION}"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"pip download flash-attn=={VERSION} failed:\n{r.stdout}\n{r.stderr}"
    return root / f"flash_attn-{VERSION}.tar.gz"


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


_LOADED: dict = {}  # the imported modules: flash-attn registers its torch ops once per process


def _is_flash(name: str) -> bool:
    return name == "flash_attn_2_cuda" or name.split(".")[0] == "flash_attn"


@contextlib.contextmanager
def real_flash_attn():
    """Inside, ``import flash_attn`` gives flash-attn 2.8.3's own interface over the stand-ins
    (its fused ops import on first use, under ``fake_cuda``: they read the device at import)."""
    from tests.gpu_fake import flash_attn_standin, flash_ops_standin

    path = str(interface_dir())
    saved = {k: v for k, v in sys.modules.items() if _is_flash(k)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, path)
    try:
        if not _LOADED:
            sys.modules["flash_attn_2_cuda"] = flash_attn_standin
            import flash_attn

            assert flash_attn.__version__ == VERSION and Path(flash_attn.__file__).is_relative_to(path)
            _LOADED.update({k: v for k, v in sys.modules.items() if _is_flash(k)})
        sys.modules.update(_LOADED)
        flash_ops_standin.reset()  # a new process: no kernel compiled yet
        with contextlib.ExitStack() as stack:
            for (obj, name), standin in flash_ops_standin.patches().items():
                stack.enter_context(mock.patch.object(obj, name, standin, create=True))
            yield sys.modules["flash_attn"]
    finally:
        _LOADED.update({k: v for k, v in sys.modules.items() if _is_flash(k)})  # ops imported inside: once
        sys.path.remove(path)
        for k in [k for k in sys.modules if _is_flash(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
