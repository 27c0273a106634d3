"""The specserve engine. At its root the public surface (``LLMEngine``, ``AsyncEngine``, ``LLM``,
their configuration, parameters and outputs); beneath it ``core`` (requests, scheduler),
``worker`` (runner, sampler, loader), ``spec_decode``, ``attention``, ``models``, ``layers``,
``distributed`` and ``utils``.

The names below load on first use (PEP 562), so that the modules that need no torch
(``engine.core.scheduler``, ``engine.core.request``, ``engine.sampling_params``, ``engine.config``,
the speculation policies, ``kvcache``) import without it.
"""

import importlib

_EXPORTS = {
    "LLM": "engine.offline",
    "CacheConfig": "engine.config",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "SchedulerConfig": "engine.config",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
