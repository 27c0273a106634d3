"""A failure while processing one request fails that request alone; a failing
drafter only turns speculation off for that step."""

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from tests.faults import fail_for
from engine.llm_engine import LLMEngine
from tests.conftest import check_no_lost_blocks
from tests.engine_core.engine_helpers import greedy, run

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11], [20, 21, 22, 23]]


def spec_engine(model, method=None):
    config = EngineConfig(
        ModelConfig(max_model_len=128, dtype="float32", device="cpu"),
        CacheConfig(num_blocks=64),
        speculative=SpeculativeConfig(method=method, num_speculative_tokens=3, verify_cost=0.05, adaptive=False),
    )
    return LLMEngine(config, model=model, tokenizer=None)


@pytest.mark.parametrize("stage", ["model", "sampler"])
def test_a_failing_request_ends_with_an_error_and_the_others_finish(tiny_model, stage):
    model = tiny_model()
    want = [f.token_ids for f in run(spec_engine(model), PROMPTS, greedy(12), prefix="ok")]
    engine = spec_engine(model)
    engine.set_fault_hook(fail_for(stage, {"bad-1"}))
    got = run(engine, PROMPTS, greedy(12), prefix="bad")
    assert got[1].finish_reason == "error" and got[1].deltas[-1].finished and got[1].deltas[-1].error
    assert [got[0].token_ids, got[2].token_ids] == [want[0], want[2]]
    check_no_lost_blocks(engine)


@pytest.mark.parametrize("method", ["ngram", "early_exit"])
def test_a_failing_drafter_falls_back_to_plain_decoding(tiny_model, method):
    model = tiny_model(num_hidden_layers=2)
    want = [f.token_ids for f in run(spec_engine(model), PROMPTS, greedy(12), prefix="plain")]
    engine = spec_engine(model, method)
    stats = []
    engine.stat_loggers.append(stats.append)
    engine.set_fault_hook(fail_for("drafter", {"spec-0"}))
    got = run(engine, PROMPTS, greedy(12), prefix="spec")
    assert [g.token_ids for g in got] == want  # exact, and nobody failed
    assert all(g.finish_reason == "length" for g in got)
    assert sum(s.spec.num_fallbacks for s in stats) > 0
    check_no_lost_blocks(engine)
    assert engine.speculator.drafter.__class__.__name__ != "ModelDrafter" or engine.speculator.drafter.kv.num_free_blocks == 64
