"""The drafter registry: one explicit mapping from a ``--speculative-config``
method name to the factory that builds its drafter.

Factories are named as ``"module:function"`` and imported only when that
method is asked for, so the engine imports no concrete drafter at module level
(the ``drafters`` package imports ``engine.spec_decode``, never the other way
round). A factory takes the ``SpeculativeConfig`` and keyword arguments: the
target model, tokenizer, device, dtype and cache sizing (see ``LLMEngine``).
"""

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # plain data at import: the command line reads DRAFTERS before torch loads
    from engine.worker.gpu_memory import DrafterMemory
    from engine.spec_decode.drafter import Drafter

DRAFTERS: dict[str, str] = {
    "ngram": "drafters.ngram:build",
    "draft_model": "drafters.draft_model:build",
    "early_exit": "drafters.early_exit:build",
    "eagle": "drafters.eagle:build_eagle",
    "eagle3": "drafters.eagle:build_eagle3",
    "ngram+eagle": "drafters.combined:build_ngram_eagle",
    "ngram+eagle3": "drafters.combined:build_ngram_eagle3",
    "suffix": "drafters.suffix:build",
    "suffix+eagle3": "drafters.combined:build_suffix_eagle3",
}

# The methods whose drafter loads weights from the config's ``model`` (a draft model or an EAGLE head).
NEEDS_MODEL = frozenset({"draft_model", "eagle", "eagle3", "ngram+eagle", "ngram+eagle3"})


def check_speculative(spec_config) -> None:
    """ValueError, in one line, for a config no drafter can be built from: an unknown method, or
    a method that loads weights without ``model`` or with a path that does not exist. Asked at
    the door (settings, ``LLMEngine``), before the target loads: a typo costs no model load."""
    method = spec_config.method
    if method is None:
        return
    if method not in DRAFTERS:
        raise ValueError(f"unknown speculative method {method!r}; known: {', '.join(DRAFTERS)}")
    if method not in NEEDS_MODEL:
        return
    if not spec_config.model:
        raise ValueError(f'speculative method "{method}" needs "model": the local directory or file of its weights')
    if not Path(spec_config.model).expanduser().exists():
        raise ValueError(f'speculative "model" {spec_config.model!r} does not exist (models are never downloaded)')


def drafter_memory(spec_config, **context) -> "DrafterMemory | None":
    """What the drafter of ``spec_config.method`` will hold on the GPU (its factory module's
    ``memory_needs``), asked before the KV cache is sized; None for drafters without weights or
    a cache of their own. ``context``: dtype, kv_dtype (the KV cache's), block_size."""
    target = DRAFTERS.get(spec_config.method)
    if target is None:
        return None
    needs = getattr(importlib.import_module(target.split(":")[0]), "memory_needs", None)
    return needs(spec_config, **context) if needs is not None else None


def build_drafter(spec_config, **context) -> "Drafter":
    """The drafter named by ``spec_config.method``; ``context`` offers the target
    model, device, dtype, cache sizing, ... to factories that need them."""
    target = DRAFTERS.get(spec_config.method)
    if target is None:
        raise ValueError(f"unknown speculative method {spec_config.method!r}; known: {sorted(DRAFTERS)}")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)(spec_config, **context)
