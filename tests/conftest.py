"""Shared fixtures of the CPU test suite.

- ``default_engine``: one engine on the default model (SmolLM2-135M-Instruct,
  float32 on the CPU), loaded once per session; engines with other settings are
  built around the same weights with ``make_engine``.
- ``tiny_model``: a factory of small random-weight Llama models that drive the
  whole engine in milliseconds.
- Every engine made by these fixtures is checked after each test: no request
  left behind and the block pool back to its full free count (no lost blocks).
  Tests of a bare ``KVCacheManager`` or ``Scheduler`` assert it themselves.
- Once the tests are collected, the heap alive then (torch, transformers, the test
  modules) is frozen out of the garbage collector's passes, as the server does after
  start-up (``freeze_startup_heap``): otherwise every full pass during a test rescans it.
"""

import dataclasses
import gc

import pytest
import torch
from transformers import LlamaConfig

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.utils.heap import freeze_startup_heap
from engine.worker.model_store import fetch_default_model
from engine.models.decoder import LlamaForCausalLM

DEFAULT_MAX_MODEL_LEN = 1024  # rope table of the shared default model; engines on it stay within


def pytest_collection_finish(session) -> None:
    freeze_startup_heap()


def pytest_sessionfinish(session) -> None:
    gc.unfreeze()  # collectable again at exit: frozen cycles would read as leaks (nanobind warns of triton's)


def check_no_lost_blocks(engine: LLMEngine) -> None:
    """Asserts that ``engine`` holds no request and all its KV blocks are free;
    aborts any leftovers first so that one failure does not cascade."""
    left = list(engine.scheduler.requests)
    for rid in left:
        engine.abort_request(rid)
    assert not left, f"requests left in the engine: {left}"
    kv = engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_blocks, f"{kv.pool.num_blocks - kv.num_free_blocks} KV blocks lost"


@pytest.fixture(scope="session")
def session_engines() -> list[LLMEngine]:
    """The session-scoped engines built so far."""
    return []


@pytest.fixture(autouse=True)
def no_lost_blocks(session_engines):
    yield
    for engine in session_engines:
        check_no_lost_blocks(engine)


def engine_config(
    max_model_len: int | None = DEFAULT_MAX_MODEL_LEN,
    num_blocks: int = 256,
    block_size: int = 16,
    seed: int = 0,
    enable_prefix_caching: bool = True,
    speculative: SpeculativeConfig | None = None,
    kv_cache_dtype: str = "auto",
    **scheduler_kw,
) -> EngineConfig:
    return EngineConfig(
        ModelConfig(max_model_len=max_model_len, dtype="float32", device="cpu", seed=seed),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching,
                    kv_cache_dtype=kv_cache_dtype),
        SchedulerConfig(**scheduler_kw),
        speculative or SpeculativeConfig(),
    )


@pytest.fixture(scope="session")
def default_model_path():
    return fetch_default_model()


@pytest.fixture(scope="session")
def default_engine(default_model_path, session_engines) -> LLMEngine:
    engine = LLMEngine(engine_config())
    session_engines.append(engine)
    return engine


@pytest.fixture(scope="session")
def float_engine(default_model_path, session_engines) -> LLMEngine:
    """The default model converted to float32 (the served default keeps its GGUF file's Q4_1
    blocks): what transformers' own model of the checkpoint is compared with."""
    config = engine_config()
    engine = LLMEngine(dataclasses.replace(config, model=dataclasses.replace(config.model, model=str(default_model_path))))
    session_engines.append(engine)
    return engine


@pytest.fixture(scope="session")
def default_tokenizer(default_engine):
    return default_engine.tokenizer


@pytest.fixture
def make_engine(request):
    """``make_engine(model=None, tokenizer=None, **engine_config kwargs)``: an engine
    around ``model`` (default: the shared default model's weights), checked for
    lost blocks when the test ends. ``max_model_len`` defaults to the model's."""
    made = []

    def make(model=None, tokenizer=None, max_model_len=None, **kw) -> LLMEngine:
        if model is None:
            default = request.getfixturevalue("default_engine")
            model, tokenizer = default.model, tokenizer or default.tokenizer
            max_model_len = max_model_len or DEFAULT_MAX_MODEL_LEN
        engine = LLMEngine(engine_config(max_model_len, **kw), model=model, tokenizer=tokenizer)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        check_no_lost_blocks(engine)


@pytest.fixture(scope="session")
def tiny_model():
    """``tiny_model(vocab_size=512, seed=0, arch=None, **config overrides)``: a 2-layer Llama
    with seeded random weights (hidden 64, 4 heads, 2 KV heads); ``arch``: a function of
    the config giving another family's ``engine.models.arch.Arch``."""

    def make(vocab_size: int = 512, seed: int = 0, arch=None, **overrides) -> LlamaForCausalLM:
        kw = dict(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            eos_token_id=None,
            bos_token_id=None,
            pad_token_id=None,
        )
        kw.update(overrides)
        config = LlamaConfig(**kw)
        model = LlamaForCausalLM(config, arch=arch(config) if arch else None)
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data.fill_(1.0)
            elif "embed" in name or "lm_head" in name:  # lm_head std 1: logits of order ten, far from ties
                p.data.normal_(0.0, 1.0, generator=gen)
            elif p.dim() == 1:  # biases
                p.data.normal_(0.0, 0.1, generator=gen)
            else:  # std 1 / sqrt(fan_in) keeps activations of order one
                p.data.normal_(0.0, p.shape[1] ** -0.5, generator=gen)
        return model.eval()

    return make
