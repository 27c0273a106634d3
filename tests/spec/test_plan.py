"""The speculation plan of a step is a pure function of what was recorded before it:
planning twice gives the same plan and changes no policy state; state changes only
when a request that ran is recorded."""

import copy

from engine import SamplingParams
from engine.config import SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.spec_decode.batch_pause import IDLE_PLANS, MIN_BATCH_PAUSE
from engine.spec_decode.policy import Candidate, ClassState, SpecPolicy, StepCosts
from tests.conftest import engine_config


def policy_state(policy: SpecPolicy):
    return copy.deepcopy((policy.states, policy.pooled, policy.batch_pauses, policy.step, policy.step_costs))


def test_planning_twice_mid_run_gives_the_same_plan_and_changes_nothing(tiny_model):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, verify_cost=0.05)
    engine = LLMEngine(engine_config(256, speculative=spec, enable_prefix_caching=False), model=tiny_model(vocab_size=64))
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], [5, 6, 5, 6, 5, 6, 5], [7, 8, 9, 10, 11]]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    plans = 0
    while engine.has_unfinished():
        before = policy_state(engine.speculator.policy)
        first, second = (engine.speculator.plan(engine.scheduler.running) for _ in range(2))
        assert first == second
        assert policy_state(engine.speculator.policy) == before
        plans += bool(first.num_draft_tokens)
        engine.step()
    assert plans > 3 and engine.speculator.policy.states == {}  # it did plan drafts; every record freed at the end


def test_a_plan_that_is_not_run_leaves_no_trace():
    """A request planned, then preempted before it ran, is not recorded: its pause is decided
    again at its next step, from the same records."""
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 0.0, StepCosts.linear(0.05))
    policy.pooled[0] = ClassState([0.0] * 4, tested=4)  # drafts never pay: the plan pauses
    d = policy.plan([Candidate("r", 0)], 1).decisions["r"]
    assert d.pause and d.num_draft_tokens == 0
    policy.end_step()  # "r" was preempted: nothing recorded
    assert "r" not in policy.states and not policy.is_paused("r")
    d = policy.plan([Candidate("r", 0)], 1).decisions["r"]
    policy.record("r", d, 0, 0)
    assert policy.is_paused("r") and policy.states["r"].classes[0].paused_until == 1 + 8


def test_a_paused_batch_size_does_not_ask_the_drafter_but_a_seeded_request_is_still_planned(tiny_model):
    """Ten decoding requests whose drafts never pay: after IDLE_PLANS idle plans the engine
    stops asking the drafter for their context classes, except the seeded one's."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    engine = LLMEngine(engine_config(256, speculative=spec, enable_prefix_caching=False), model=tiny_model(vocab_size=64))
    engine.speculator.cost_tracker = None  # keep the table below: extra rows cost as much as requests
    engine.speculator.policy.step_costs = StepCosts((1, 9, 33), (1.0, 2.0, 5.0), one_token_s=0.01)
    engine.speculator.policy.pooled = {n: ClassState([0.1] * 4, tested=4) for n in range(1, 5)}
    asked = []
    context_class = engine.speculator.drafter.context_class
    engine.speculator.drafter.context_class = lambda r: asked.append(r.request_id) or context_class(r)
    for i in range(10):
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, seed=1 if i == 0 else None)
        engine.add_request(f"r{i}", [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], params)
    per_step = []
    while engine.has_unfinished():
        asked.clear()
        engine.step()
        per_step.append(set(asked))
    decoding = [s for s in per_step if s]
    assert decoding[0] == {f"r{i}" for i in range(10)}
    assert all(len(s) == 10 for s in decoding[:IDLE_PLANS])
    assert all(s == {"r0"} for s in decoding[IDLE_PLANS : IDLE_PLANS + MIN_BATCH_PAUSE])
    assert engine.speculator.policy.states == {}
