"""The family tests' prompts and engines, shared by the test modules of tests/models."""

import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import check_no_lost_blocks
from tests.models.families import WINDOW

NEW_TOKENS = 32


def make_prompts() -> list[list[int]]:
    """5, 20 and 40 tokens; the last two repeat themselves (prompt lookup finds drafts)."""
    g = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(3, 40000, (n,), generator=g).tolist()  # noqa: E731
    return [ids(5), ids(5) * 4, ids(10) * 4]


PROMPTS = make_prompts()
assert len(PROMPTS[-1]) > 3 * WINDOW


def family_engine(path, speculative: SpeculativeConfig | None = None, **model) -> LLMEngine:
    config = EngineConfig(
        ModelConfig(**{"model": str(path), "dtype": "float32", "device": "cpu", "max_model_len": 256, **model}),
        CacheConfig(block_size=16, num_blocks=96), SchedulerConfig(), speculative or SpeculativeConfig(),
    )
    return LLMEngine(config)


def greedy_tokens(engine: LLMEngine, prompts=PROMPTS, max_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    check_no_lost_blocks(engine)
    if engine.speculator.drafter is not None and hasattr(engine.speculator.drafter, "kv"):
        assert engine.speculator.drafter.kv.num_free_blocks == engine.speculator.drafter.kv.pool.num_blocks
    return [r.output_token_ids for r in reqs]
