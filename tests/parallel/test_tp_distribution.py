"""Sampling through a target split over two processes: whole speculative rounds
(the early-exit drafter runs the split target's first layer, through the same
messages) emit exactly the target's processed distribution, and the same test
rejects a sampler that resamples from p instead of the residual (its power).
The distribution helpers are the speculative suite's (``tests/spec``). Slow."""

import pytest
import torch

from engine.spec_decode import rejection_sampler
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.worker.loader import load_model
from tests.parallel.checkpoints import save_random_llama
from tests.spec.distribution import NUM_SAMPLES, SETTINGS, V, exact_joint, llama_logits, p_value, resample_from_p, sample_joint

pytestmark = pytest.mark.slow

# tests/spec/test_distribution.py's early-exit model: later layers smaller, so layer 0 drafts fairly.
CONFIG = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
STD = {"embed": 0.5, "lm_head": 0.5, "layers.0.": 0.3, "layers.": 0.25}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("bigram-like"), std=STD, **CONFIG)


@pytest.fixture(scope="module")
def exact_logits(checkpoint):
    """The unsplit target's next-token logits, for the exact distribution."""
    return llama_logits(load_model(checkpoint, torch.float32, torch.device("cpu")))


def split_engine(path) -> LLMEngine:
    config = EngineConfig(
        ModelConfig(model=str(path), device="cpu", dtype="float32", max_model_len=64),
        CacheConfig(block_size=16, num_blocks=3000),
        SchedulerConfig(max_num_seqs=2048, max_num_batched_tokens=16384),
        SpeculativeConfig(method="early_exit", num_speculative_tokens=2, num_layers=1, adaptive=False, verify_cost=0.1),
        ParallelConfig(tensor_parallel_size=2),
    )
    return LLMEngine(config)


@pytest.mark.parametrize("broken", [False, True], ids=["exact", "broken-sampler-is-caught"])
def test_split_target_emits_its_distribution(checkpoint, exact_logits, broken, monkeypatch):
    if broken:  # sampling happens on rank 0 only: patching this process breaks it
        monkeypatch.setattr(rejection_sampler, "residual_distribution", resample_from_p)
    engine = split_engine(checkpoint)
    try:
        counts = sample_joint(engine, SETTINGS[0], NUM_SAMPLES)
    finally:
        engine.close()
    p = p_value(counts, exact_joint(exact_logits, SETTINGS[0]))
    assert (p < 1e-3) if broken else (p > 1e-3), p
