"""The drafter registry: one explicit mapping from a ``--speculative-config``
method name to the factory that builds its drafter.

Factories are named as ``"module:function"`` and imported only when that
method is asked for, so the engine imports no concrete drafter at module level
(the ``drafters`` package imports ``engine.spec_decode``, never the other way
round). A factory takes the ``SpeculativeConfig`` and keyword arguments: the
target model, tokenizer, device, dtype and cache sizing (see ``LLMEngine``).
"""

import importlib

from engine.gpu_memory import DrafterMemory
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


def drafter_memory(spec_config, **context) -> DrafterMemory:
    """What the drafter of ``spec_config.method`` will hold on the GPU (its factory module's
    ``memory_needs``; nothing for drafters without weights or a cache of their own), asked
    before the KV cache is sized. ``context``: dtype, kv_dtype (the KV cache's), block_size."""
    target = DRAFTERS.get(spec_config.method)
    if target is None:
        return DrafterMemory()
    needs = getattr(importlib.import_module(target.split(":")[0]), "memory_needs", None)
    return needs(spec_config, **context) if needs is not None else DrafterMemory()


def build_drafter(spec_config, **context) -> Drafter:
    """The drafter named by ``spec_config.method``; ``context`` offers the target
    model, device, dtype, cache sizing, ... to factories that need them."""
    target = DRAFTERS.get(spec_config.method)
    if target is None:
        raise ValueError(f"unknown speculative method {spec_config.method!r}; known: {sorted(DRAFTERS)}")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)(spec_config, **context)
