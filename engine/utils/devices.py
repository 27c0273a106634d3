"""Which device the engine runs on, and why: said in the start-up log and in /health.

``--device auto`` takes CUDA when it works and the CPU otherwise, and says which
and why: a CPU build of torch, or a CUDA build whose GPU cannot be used (no GPU
visible, or a driver older than the torch build's CUDA needs: a CUDA 13 torch
wants a driver >= 580). A GPU deployment passes ``--device cuda``, which fails the
start-up with that reason instead of serving slowly on the CPU.
"""

import platform
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DeviceChoice:
    device: torch.device
    reason: str  # why this device, in words for the log and /health
    fell_back: bool = False  # auto took the CPU on a CUDA build of torch: a GPU machine misconfigured?


def choose_device(requested: str) -> DeviceChoice:
    """The device for ``--device requested`` (auto | cpu | cuda | cuda:N); ValueError when
    a CUDA device is asked for and cannot be used."""
    if requested == "cpu":
        return DeviceChoice(torch.device("cpu"), "--device cpu")
    usable, why = cuda_status()
    if requested == "auto":
        if usable:
            return DeviceChoice(torch.device("cuda"), f"--device auto: {why}")
        if torch.version.cuda is None:
            return DeviceChoice(torch.device("cpu"), f"--device auto: {why}")
        return DeviceChoice(torch.device("cpu"), f"--device auto fell back to the CPU: {why}", fell_back=True)
    device = torch.device(requested)
    if device.type != "cuda":
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got {requested!r}")
    if not usable:
        raise ValueError(f"--device {requested}: CUDA cannot be used: {why}")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {requested}: only {torch.cuda.device_count()} CUDA devices are visible")
    return DeviceChoice(device, f"--device {requested}: {why}")


def cuda_status() -> tuple[bool, str]:
    """(whether CUDA can be used, why or why not)."""
    if torch.version.cuda is None and not torch.cuda.is_available():
        return False, f"this torch ({torch.__version__}) is a CPU build"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        usable = torch.cuda.is_available()
    if usable:
        n = torch.cuda.device_count()
        return True, f"{n} CUDA device(s), {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda})"
    said = "; ".join(str(w.message).strip() for w in caught) or "no CUDA device is visible"
    return False, f"torch {torch.__version__} is built for CUDA {torch.version.cuda}, but CUDA is unusable: {said}"


def cpu_flags() -> str:
    """/proc/cpuinfo on x86-64 (its flags say which kernels build), else empty."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return ""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
