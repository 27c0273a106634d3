"""The CPU threading runtime: Intel's OpenMP in place of GNU's, without the user asking.

PyTorch's CPU wheels link GNU OpenMP (libgomp). Its threads wait for the next
parallel region in a tight spin and then sleep; a server has other threads (the
event loop, the HTTP client on the same cores) that wake up between the ~150
parallel regions of a decode step, and each time one of them takes a core from
an OpenMP thread the whole region waits for it. Intel's OpenMP (libiomp5, the
``intel-openmp`` wheel) yields while it waits, and loaded first it answers
PyTorch's GNU OpenMP calls as well. vLLM's CPU build asks its users to preload
it by hand (``LD_PRELOAD``); here the command line does it: ``ensure()`` re-runs
the current command once with the library preloaded, before anything has
imported torch (docs/cpu.md says what it is worth).

``SPECSERVE_OPENMP=gnu`` keeps GNU OpenMP (the re-run is skipped); it is also
skipped where the library is missing (the wheel exists for x86-64 Linux only)
and when it is already preloaded. This module imports no torch.
"""

import os
import sys
from pathlib import Path

LIBRARY = "libiomp5.so"
ENV_SWITCH = "SPECSERVE_OPENMP"  # "intel" (default) or "gnu"


def intel_openmp_path() -> Path | None:
    """The libiomp5 that the ``intel-openmp`` wheel installed into this environment."""
    for base in (Path(sys.prefix) / "lib", Path(sys.base_prefix) / "lib"):
        if (base / LIBRARY).is_file():
            return base / LIBRARY
    return None


def is_preloaded() -> bool:
    return LIBRARY in os.environ.get("LD_PRELOAD", "")


def _wants_intel() -> bool:
    return os.environ.get(ENV_SWITCH, "intel").lower() != "gnu" and sys.platform == "linux"


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with libiomp5 preloaded, where it applies."""
    env = dict(os.environ if env is None else env)
    lib = intel_openmp_path()
    if lib is None or LIBRARY in env.get("LD_PRELOAD", "") or env.get(ENV_SWITCH, "intel").lower() == "gnu":
        return env
    env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    return env


def ensure(module: str, argv: list[str]) -> None:
    """Re-run ``python -m module argv...`` with Intel's OpenMP preloaded, unless it
    is already (or cannot be, or must not be). Call before importing torch; it
    does not return when it re-runs."""
    if not _wants_intel() or is_preloaded() or "torch" in sys.modules or intel_openmp_path() is None:
        return
    env = preload_env()
    env[ENV_SWITCH] = env.get(ENV_SWITCH, "intel")
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def describe() -> str:
    """Which OpenMP runtime this process runs (for the start-up log)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    if LIBRARY in maps:
        return f"Intel OpenMP ({LIBRARY} preloaded)"
    return "GNU OpenMP" if "libgomp" in maps else "unknown"


if __name__ == "__main__":  # python -m server.openmp CMD ARGS...: run CMD with the preload (make test)
    os.execvpe(sys.argv[1], sys.argv[1:], preload_env())
