"""A device lint: tensor factories called without ``device=`` from the engine's own code.

On the step path every new tensor should say where it goes: a factory without
``device=`` makes a CPU tensor, which on a GPU is either a device-mixing crash
waiting for its first CUDA run or a hidden blocking host-to-device copy. Meant
for tensors that really belong on the host: write ``device="cpu"``.

``with DeviceLint() as lint: ...`` records ``lint.findings``: (file:line, factory)
for each such call whose caller is under ``engine/``, ``drafters/`` or ``kvcache/``.
"""

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parents[2]
WATCHED = tuple(str(ROOT / d) + "/" for d in ("engine", "drafters", "kvcache"))
FACTORIES = {
    torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand,
    torch.randn, torch.randint, torch.randperm, torch.linspace, torch.eye, torch.empty_strided,
}


class DeviceLint(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.findings: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            where = _caller()
            if where is not None:
                self.findings.append((where, func.__name__))
        return func(*args, **kwargs)


def _caller() -> str | None:
    """file:line of the nearest frame in the watched packages, if the call comes from one."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(WATCHED):
            return f"{Path(name).relative_to(ROOT)}:{frame.f_lineno}"
        if "/torch/" not in name:  # a test or another library made the call
            return None
        frame = frame.f_back
    return None
