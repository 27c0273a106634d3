"""A seeded request writes the same tokens when it is preempted as alone, for every
drafter: the recompute after a preemption stops one token short of the request's
tokens, whether it fits one step or spans several, so that its last token decodes
with the drafts it would have had, drawing the same random numbers."""

import pytest

from engine import SamplingParams
from engine.llm_engine import LLMEngine
from engine.spec_decode.policy import SpecPolicy, StepCosts
from tests.conftest import check_no_lost_blocks
from tests.spec.seeded_engines import PROMPT, build

SEEDED = SamplingParams(max_tokens=40, temperature=1.0, seed=5, ignore_eos=True)
NUM_BLOCKS = 40  # of 4 tokens: four requests of 65 tokens need 68
# A GPU-shaped table, pinned: the seeded request's choices depend on nothing but its record.
TABLE = StepCosts((1, 2, 4, 8, 16, 32, 64), (1.0, 1.02, 1.04, 1.08, 1.3, 2.0, 2.8))


def pinned(name: str, tmp_path) -> LLMEngine:
    engine = build(name, tmp_path, num_blocks=NUM_BLOCKS)
    engine.speculator.policy = SpecPolicy(engine.config.speculative, 0.05, TABLE)
    engine.speculator.cost_tracker = None
    return engine


def others(n: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Sampled, unseeded requests on their own prompts (no shared prefix), started first."""
    return [(f"o{i}", [(5 * i + 3 * j + 1) % 16 for j in range(25)],
             SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True)) for i in range(n)]


def serve(engine: LLMEngine, requests) -> dict:
    reqs = {rid: engine.add_request(rid, prompt, params) for rid, prompt, params in requests}
    while engine.has_unfinished():
        engine.step()
    return reqs


@pytest.mark.parametrize("name", ["ngram", "draft_model", "early_exit", "eagle", "eagle3", "eagle3-tree"])
def test_a_preempted_seeded_request_writes_what_it_writes_alone(name, tmp_path):
    alone = serve(pinned(name, tmp_path), [("s", PROMPT, SEEDED)])["s"].output_token_ids
    engine = pinned(name, tmp_path)
    stats = []
    engine.stat_loggers.append(stats.append)
    seeded = serve(engine, others(3) + [("s", PROMPT, SEEDED)])["s"]
    assert seeded.num_preemptions > 0  # the pressure was real
    assert sum(s.spec.num_draft_tokens for s in stats if s.spec) > 20  # and so was the speculation
    assert seeded.output_token_ids == alone
    check_no_lost_blocks(engine)
