"""A seeded request writes the same tokens whatever the server served before
it or serves beside it, with the adaptive policy on: its draft lengths come
from its own record only, so it draws the same random numbers. Without that
isolation the same scenarios change its output (the tests have power)."""

import dataclasses

import pytest
import torch

from drafters.draft_model import ModelDrafter
from engine import SamplingParams
from engine.config import SpeculativeConfig
from engine.spec_decode.policy import MIN_PAUSE, PRIOR_ACCEPTANCE, Candidate, ClassState, SpecPolicy, StepCosts
from tests.spec.bigram import BigramLM, bigram_table, perturbed
from tests.spec.distribution import PROMPT, V, make_engine

TARGET = bigram_table(V, seed=1)
DRAFT = perturbed(TARGET, seed=2)
SEEDED = SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
# Drafts nearly free alone, a compute-bound pass beside 16 others: the batch changes the choice.
BATCH_COSTS = StepCosts((1, 5, 17, 33), (1.0, 1.05, 2.0, 4.0))


def engine(costs: StepCosts | None = None):
    e = make_engine(
        BigramLM(TARGET), ModelDrafter(BigramLM(DRAFT), 1, 3000, 16, torch.float32, torch.device("cpu"), 0.05),
        k=4, adaptive=True, verify_cost=0.05,
    )
    if costs is not None:
        e.speculator.policy.step_costs = costs
    return e


def serve(e, requests: dict[str, SamplingParams]) -> dict[str, tuple[list[int], list[int]]]:
    """Runs ``requests`` (id -> params) together; id -> (output tokens, drafts verified per round)."""
    rounds = {rid: [] for rid in requests}
    execute = e.runner.execute

    def logged(out, *args):
        result = execute(out, *args)
        for rid, k in result.num_draft_tokens.items():
            rounds[rid].append(k)
        return result

    e.runner.execute = logged
    reqs = {rid: e.add_request(rid, PROMPT, p) for rid, p in requests.items()}
    while e.has_unfinished():
        e.step()
    e.runner.execute = execute
    return {rid: (r.output_token_ids, rounds[rid]) for rid, r in reqs.items()}


def traffic(n: int, prefix: str) -> dict[str, SamplingParams]:
    """Unseeded requests whose drafts are mostly accepted: greedy on both sides."""
    return {f"{prefix}{i}": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True) for i in range(n)}


def seeded_after_traffic(costs=None):
    alone = serve(engine(costs), {"s": SEEDED})["s"]
    busy = engine(costs)
    for rid, params in traffic(4, "before").items():  # one at a time: each drafts 4 and passes most
        serve(busy, {rid: params})
    pooled = busy.speculator.policy.pooled[0].rates
    assert max(abs(r - PRIOR_ACCEPTANCE) for r in pooled) > 0.2, pooled  # the history moved the pooled rates
    after = serve(busy, {"s": SEEDED})["s"]
    beside = serve(busy, {"s": SEEDED, **traffic(16, "beside")})["s"]
    return alone, after, beside


def test_a_seeded_request_ignores_what_was_served_before_and_beside_it():
    alone, after, beside = seeded_after_traffic(BATCH_COSTS)
    assert len(alone[1]) > 5 and len(set(alone[1])) > 1  # several rounds, of several lengths
    assert after == alone
    assert beside == alone


def test_without_isolation_the_same_history_changes_the_output(monkeypatch):
    monkeypatch.setattr(SpecPolicy, "_decide", _not_isolated(SpecPolicy._decide))
    alone, after, beside = seeded_after_traffic(BATCH_COSTS)
    assert after[1] != alone[1] and after[0] != alone[0]
    assert beside[0] != alone[0]


def _not_isolated(decide):
    """The policy before isolation: every request starts from the pooled rates, priced in its batch."""
    return lambda self, candidate, batch, rows: decide(self, dataclasses.replace(candidate, isolated=False), batch, rows)


@pytest.mark.parametrize("seed", [None, 3])
def test_isolation_is_for_seeded_requests_only(seed):
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    policy = SpecPolicy(config, 0.05, BATCH_COSTS)
    def plan(p: SpecPolicy, rid: str, num_running: int = 1):
        return p.plan([Candidate(rid, 0, isolated=seed is not None)], num_running).decisions[rid]

    alone = plan(SpecPolicy(config, 0.05, BATCH_COSTS), "a").num_draft_tokens  # a fresh server, no history
    policy.pooled[0] = ClassState([0.0] * 4, tested=4)  # earlier requests: every draft rejected
    first = plan(policy, "b")
    policy.pooled[0] = ClassState([0.9] * 4, tested=4)  # ... or nearly every draft accepted
    crowded = plan(policy, "c", num_running=16).num_draft_tokens
    first, paused = first.num_draft_tokens, first.pause
    if seed is None:  # the pooled rates and the batch both count
        assert first == 0 and paused
        assert crowded not in (0, alone)
    else:  # neither does: both choose as a request alone on a fresh server
        assert first == crowded == alone == 3


def isolated_slots(policy: SpecPolicy, rid: str, isolated: bool = True) -> int:
    return policy.plan([Candidate(rid, 0, isolated=isolated)], 1).decisions[rid].num_draft_tokens


def test_a_seeded_request_is_priced_by_the_start_up_costs_whatever_the_tracker_makes_of_them():
    """The cost tracker replaces ``step_costs`` as steps run slower: a shared request's
    choice follows it, a seeded one's stays that of the start-up table."""
    start = StepCosts((1, 2, 5, 9), (1.0, 1.02, 1.06, 1.3), one_token_s=0.01)
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 0.05, start)
    seeded, shared = isolated_slots(policy, "s"), isolated_slots(policy, "u", isolated=False)
    policy.step_costs = StepCosts((1, 2, 5, 9), (1.0, 1.3, 2.0, 3.0), one_token_s=0.01, verify_fixed=0.1)
    assert isolated_slots(policy, "u", isolated=False) < shared  # the new table does change choices
    assert isolated_slots(policy, "s2") == seeded


def test_a_seeded_requests_pause_runs_on_its_own_steps():
    """Steps that a request does not run (it waited for room in the budget, or was
    preempted) do not count down its pause: only its own steps do."""
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4)
    for isolated in (True, False):
        policy = SpecPolicy(config, 0.05, StepCosts.linear(0.05))
        d = policy.plan([Candidate("r", 0, isolated=isolated)], 1).decisions["r"]
        while not d.pause:  # every draft rejected until drafting stops paying
            policy.record("r", d, d.num_draft_tokens, 0)
            policy.end_step()
            d = policy.plan([Candidate("r", 0, isolated=isolated)], 1).decisions["r"]
        policy.record("r", d, 0, 0)
        policy.end_step()
        for _ in range(3 * MIN_PAUSE):  # steps of other requests
            policy.end_step()
        paused = isolated_slots(policy, "r", isolated) == 0
        assert paused == isolated
