"""The speculation policy: the reference's choices, and non-anticipating ones."""

import pytest

from engine.config import SpeculativeConfig
from engine.spec_decode.batch_pause import IDLE_PLANS, MIN_BATCH_PAUSE
from engine.spec_decode.fixed_policy import FixedPolicy
from engine.spec_decode.policy import (
    Candidate,
    ClassState,
    SpecPolicy,
    StepCosts,
)


def planned_with_rates(rates: list[float], draft_cost: float, verify_cost: float = 0.0) -> int:
    """Drafts the policy plans for a new request of a class whose pooled rates are ``rates``
    (conditional acceptance per position), verification priced at ``verify_cost`` a draft."""
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=len(rates)), draft_cost,
                        StepCosts.linear(verify_cost))
    policy.pooled[0] = ClassState(list(rates), tested=len(rates))
    return slots(policy, "new")


def test_the_references_best_draft_counts():
    """The reference's worked choices at i.i.d. acceptance a and draft cost c, verification
    free: the count g in 1..20 with the most (1 + a + ... + a^g) / (1 + g c)."""
    assert planned_with_rates([0.8] * 20, 0.05) == 8  # 3.09 tokens per unit of cost
    assert planned_with_rates([0.8] * 20, 0.2) == 4  # 1.87
    assert planned_with_rates([0.6] * 20, 0.05) == 4  # 1.92


def test_conditional_rates_not_powers_of_the_first():
    """Acceptance far from i.i.d. (drafts that start right stay right, then stop): the
    running product of the rates, not powers of the first one, prices the count."""
    assert planned_with_rates([1.0, 1.0, 0.05, 0.05, 0.05], 0.05, 0.05) == 2  # 3 / 1.2 beats 3.05 / 1.3
    assert planned_with_rates([0.5, 1.0, 1.0, 1.0, 1.0], 0.05, 0.05) == 5
    assert planned_with_rates([0.5] * 5, 0.05, 0.05) == 2  # i.i.d. at the first rate


def slots(policy: SpecPolicy, rid: str = "r", klass: int | None = 0, num_running: int = 1) -> int:
    """The plan's draft slots for one request (a pure query)."""
    return policy.plan([Candidate(rid, klass)], num_running).num_draft_tokens.get(rid, 0)


def step(policy: SpecPolicy, rid: str = "r", accepted: int = 0, drafted: int | None = None, klass: int | None = 0) -> int:
    """One engine step of one request: plan, verify ``drafted`` drafts (default: every slot)
    of which ``accepted`` are kept, record, end the step. Returns the planned slots."""
    d = policy.plan([Candidate(rid, klass)], 1).decisions[rid]
    policy.record(rid, d, d.num_draft_tokens if drafted is None else drafted, min(accepted, d.num_draft_tokens))
    policy.end_step()
    return d.num_draft_tokens


def test_copying_raises_the_draft_length_and_misses_pause_drafting():
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=8), 0.0, StepCosts.linear(0.05))
    first = slots(policy)
    for _ in range(10):
        step(policy, accepted=8)
    assert slots(policy) == 8 >= first
    while step(policy, accepted=0):  # the step whose plan finds that drafts do not pay starts a pause
        pass
    assert slots(policy) == 0 and policy.is_paused("r")
    for _ in range(8):
        policy.end_step()
    assert slots(policy) > 0  # retries after the pause


def test_no_context_class_and_fixed_length():
    assert slots(SpecPolicy(SpeculativeConfig(method="ngram"), 0.0, StepCosts.linear(0.05)), klass=None) == 0
    fixed = FixedPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False))
    assert slots(fixed) == 3 and slots(fixed, klass=None) == 0


def test_a_probe_after_a_pause_that_misses_pauses_again_at_once():
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 0.0, StepCosts.linear(0.05))
    while step(policy, accepted=0) or not policy.is_paused("r"):
        pass
    for _ in range(8):
        policy.end_step()
    assert step(policy, accepted=0) > 0  # the probe, missed
    assert policy.is_paused("r") and policy.states["r"].classes[0].pause_len == 32


def test_the_pooled_rates_keep_a_request_drafting_through_a_run_of_misses():
    """First drafts accepted 40% of the time over all requests pay (1.4 tokens for 1.1 of
    a step); four misses in a row take one request's own record to 0.1, below paying.
    The pooled rates' second say keeps it drafting instead of pausing it. A seeded request
    has its own record only: a run of misses pauses it."""
    policy = SpecPolicy(SpeculativeConfig(method="eagle", num_speculative_tokens=4), 0.0, StepCosts.linear(0.1))
    policy.pooled[0] = ClassState([0.4] * 4, tested=4, rounds=100)
    for _ in range(4):
        assert step(policy, accepted=0) > 0
    assert policy.states["r"].classes[0].rates[0] < 0.1 < policy.pooled[0].rates[0]
    assert slots(policy) > 0 and not policy.is_paused("r")
    seeded = policy.plan([Candidate("s", 0, isolated=True)], 1).decisions["s"]
    misses = 0
    while seeded.num_draft_tokens:
        policy.record("s", seeded, seeded.num_draft_tokens, 0)
        policy.end_step()
        seeded, misses = policy.plan([Candidate("s", 0, isolated=True)], 1).decisions["s"], misses + 1
    assert seeded.pause and misses < 10


def test_a_costly_drafter_probes_with_one_draft_and_one_lucky_hit_does_not_restart_it():
    # Drafts cost 0.4 of a step each and are right 10% of the time: they never pay.
    policy = SpecPolicy(SpeculativeConfig(method="early_exit", num_speculative_tokens=3), 0.4, StepCosts.linear(0.0))
    d = policy.plan([Candidate("r", 0)], 1).decisions["r"]
    for i in range(100):  # a long record over all requests of the class
        policy.record("r", d, 1, int(i % 10 == 0))
        policy.end_step()
    assert policy.pooled[0].rates[0] < 0.2
    st = policy.states["r"].classes[0]
    step(policy)
    while policy.is_paused("r"):
        policy.end_step()
    assert st.probing and step(policy, accepted=1) == 1  # the probe: one draft, whatever the estimate; accepted ...
    assert slots(policy) == 0  # ... but the class's record still says drafts do not pay
    step(policy)
    assert st.paused_until == policy.step - 1 + 8  # and the hit shortened the pause: the next probe comes soon


def test_a_request_new_to_a_class_whose_probes_keep_missing_waits_longer_before_its_first_probe():
    """Drafts that never pay (cost 0.4, rarely right): each missed probe of any request
    doubles the class's pooled pause, which the next request starts from; an isolated
    request starts from the prior's; a round that accepts halves the pooled pause."""
    policy = SpecPolicy(SpeculativeConfig(method="early_exit", num_speculative_tokens=3), 0.4, StepCosts.linear(0.0))
    policy.pooled[0] = ClassState([0.1] * 3, tested=3)
    for rid in ("a", "b", "c"):
        step(policy, rid)  # not paying: paused at once
        while policy.is_paused(rid):
            policy.end_step()
        assert step(policy, rid) == 1  # its probe, missed
    assert policy.pooled[0].pause_len == 8 * 2**3
    step(policy, "d")
    assert policy.states["d"].classes[0].paused_until == policy.step - 1 + 64
    assert policy.plan([Candidate("e", 0, isolated=True)], 1).decisions["e"].fresh.pause_len == 8
    probe = policy.plan([Candidate("c", 0)], 1).decisions["c"]
    while not probe.num_draft_tokens:
        policy.end_step()
        probe = policy.plan([Candidate("c", 0)], 1).decisions["c"]
    policy.record("c", probe, 1, 1)
    assert policy.pooled[0].pause_len == 32


def test_context_classes_keep_their_own_statistics_and_pool_across_requests():
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=8), 0.0, StepCosts.linear(0.05))
    misses = 0
    while step(policy, klass=1, accepted=0):  # short matches miss, until even the pooled rate says so ...
        misses += 1
    assert slots(policy, klass=1) == 0 and policy.is_paused("r")
    # The request's own record alone pauses after 5 misses (0.5 * 0.7^5 < 0.08); the pooled one,
    # a plain mean over its first rounds with the prior as one of them, agrees a miss later
    # (0.5 / 7 < 0.08): its prior does not keep a class that never paid drafting.
    assert misses == 6
    # ... a long match in the same request still drafts
    assert step(policy, klass=5, accepted=8) > 0 and not policy.is_paused("r")
    for _ in range(20):
        step(policy, klass=5, accepted=8)
    assert slots(policy, klass=5) == 8
    # A new request starts from the rates pooled over earlier ones.
    assert slots(policy, "s", klass=5) >= 6 > slots(policy, "t", klass=3)
    assert step(policy, "s", klass=None) == 0 and not policy.is_paused("s")  # the drafter has nothing to propose


def test_a_round_that_only_breaks_even_is_not_drafted():
    """A first draft accepted 12% of the time at 1.1 steps per round is worth 1.02 tokens
    a step: within the estimates' error of plain decoding, so no draft; at 20%, 1.09."""
    assert planned_with_rates([0.12] * 4, 0.0, 0.1) == 0
    assert planned_with_rates([0.2] * 4, 0.0, 0.1) > 0


def test_a_nonlinear_cost_table_moves_the_choice():
    rates = [0.3] * 8
    cheap_then_steep = StepCosts((1, 5, 6, 9), (1.0, 1.0, 2.0, 2.0))  # 1-4 drafts free, then a step
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=8), 0.0, cheap_then_steep)
    policy.pooled[0] = ClassState(rates, tested=8)  # as if earlier requests had measured them
    assert slots(policy) == 4  # free drafts up to 4, then a step that doubles the cost


def test_step_costs_interpolate_and_extrapolate():
    t = StepCosts((1, 5, 17), (1.0, 1.2, 2.4))
    assert t(1) == 1.0 and t(3) == pytest.approx(1.1) and t(11) == pytest.approx(1.8) and t(29) == pytest.approx(3.6)
    assert t.verify(4, 1) == pytest.approx(1.2)
    assert t.verify(4, 5) == pytest.approx(1 + (t(9) - 1.2) * 5 / 1.2)


def test_drafting_that_pays_alone_stops_in_a_compute_bound_batch():
    costs = StepCosts((1, 5, 17, 33), (1.0, 1.05, 2.0, 4.0))  # cheap extra tokens at batch 1, not at 16
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 0.0, costs)
    policy.pooled[0] = ClassState([0.6] * 4, tested=4)
    assert slots(policy, num_running=1) == 4
    assert slots(policy, "s", num_running=16) == 0


def test_the_first_request_to_draft_in_a_step_bears_the_passs_fixed_cost():
    """Each of 16 requests gains a little from one draft on its own rows; the pass that
    verifies costs a fixed 0.3 of a one-token pass more, which the first request to draft
    bears alone (0.3 * 16 / T(16) = 2.5 of its share of a step) and cannot pay: the step
    decodes plainly. Without the fixed cost all draft. A seeded (isolated) request is
    planned first, priced alone with the fixed cost, and drafts; the pass then verifies
    anyway, and the others draft too, paying their rows only."""
    table = ((1, 17, 33), (1.0, 2.0, 3.0))  # T(16) = 1.94, 1/16 of a one-token pass per extra row
    policy = lambda fixed: SpecPolicy(  # noqa: E731
        SpeculativeConfig(method="ngram", num_speculative_tokens=1), 0.0,
        StepCosts(*table, one_token_s=0.01, verify_fixed=fixed),
    )
    cheap, dear = policy(0.0), policy(0.3)
    for p in (cheap, dear):
        p.pooled[0] = ClassState([0.7], tested=1)
    candidates = [Candidate(f"r{i}", 0) for i in range(16)]
    assert sum(cheap.plan(candidates, 16).num_draft_tokens.values()) == 16
    assert dear.plan(candidates, 16).num_draft_tokens == {}
    seeded = candidates[:-1] + [Candidate("seeded", 0, isolated=True)]  # last in order, planned first
    assert dear.plan(seeded, 16).num_draft_tokens == {c.request_id: 1 for c in seeded}


def test_a_batch_size_whose_plans_grant_nothing_stops_planning_for_a_while():
    """At 16 requests drafts at a 0.3 acceptance do not pay: after IDLE_PLANS idle plans
    their bucket (16-31) is not planned for MIN_BATCH_PAUSE steps (a seeded request still
    is), then planned again, and idle again it pauses twice as long. Batch 4 is unaffected,
    and a plan that grants drafts keeps its bucket planning."""
    costs = StepCosts((1, 5, 17, 33), (1.0, 1.05, 2.0, 4.0), one_token_s=0.01)
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 0.0, costs)
    policy.pooled[0] = ClassState([0.3] * 4, tested=4)
    candidates = [Candidate(f"r{i}", 0) for i in range(15)] + [Candidate("seeded", 0, isolated=True)]
    for _ in range(IDLE_PLANS):
        assert policy.plans_shared(16) and policy.plans_shared(20)
        plan = policy.plan(candidates, 16)
        assert plan.num_draft_tokens.keys() == {"seeded"}  # priced alone, as at batch 1
        policy.end_step(plan)
    assert not policy.plans_shared(16) and not policy.plans_shared(31) and policy.plans_shared(32)
    assert policy.plans_shared(4)
    plan = policy.plan(candidates, 16)
    assert set(plan.decisions) == set(plan.num_draft_tokens) == {"seeded"}
    for _ in range(MIN_BATCH_PAUSE - 1):
        policy.end_step(policy.plan(candidates, 16))
    assert not policy.plans_shared(16)
    policy.end_step(policy.plan(candidates, 16))
    assert policy.plans_shared(16)
    for _ in range(IDLE_PLANS):
        policy.end_step(policy.plan(candidates, 16))
    for _ in range(2 * MIN_BATCH_PAUSE):
        assert not policy.plans_shared(16)
        policy.end_step(policy.plan(candidates, 16))
    assert policy.plans_shared(16)
    policy.pooled[0] = ClassState([0.95] * 4, tested=4)  # drafting pays: planning goes on
    for _ in range(3 * IDLE_PLANS):
        plan = policy.plan([Candidate(f"n{i}", 0) for i in range(16)], 16)
        assert plan.num_draft_tokens
        policy.end_step(plan)
    assert policy.plans_shared(16)
