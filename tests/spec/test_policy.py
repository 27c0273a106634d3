"""The speculation policy: the reference's formulas, and non-anticipating choices."""

import pytest

from engine.config import SpeculativeConfig
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_policy import ClassState, SpecPolicy, StepCosts, best_gamma, expected_tokens, speedup, survival


def test_reference_numbers():
    assert expected_tokens(0.8, 2) == pytest.approx(2.44)
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert speedup(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert best_gamma(0.8, 0.05, 20)[0] == 8 and best_gamma(0.8, 0.05, 20)[1] == pytest.approx(3.09, abs=0.01)
    assert best_gamma(0.8, 0.2, 20)[0] == 4 and best_gamma(0.8, 0.2, 20)[1] == pytest.approx(1.87, abs=0.01)
    assert best_gamma(0.6, 0.05, 20)[0] == 4 and best_gamma(0.6, 0.05, 20)[1] == pytest.approx(1.92, abs=0.01)
    assert speedup(0.8, 4, 0.05, parallel=True) == pytest.approx(3.3616 / 1.05)


def test_survival_of_conditional_rates():
    assert survival([0.5, 1.0, 0.5], 3) == [0.5, 0.5, 0.25]
    assert expected_tokens([0.5, 1.0, 0.5], 2) == 2.0


def request() -> Request:
    return Request("r", [1, 2, 3], SamplingParams(), frozenset())


def test_copying_raises_the_draft_length_and_misses_pause_drafting():
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=8), 0.0, StepCosts.linear(0.05))
    req = request()
    first = policy.num_draft_slots(req)
    for _ in range(10):
        policy.record(req, 8, 8)
    assert policy.num_draft_slots(req) == 8 >= first
    for _ in range(20):
        policy.record(req, 8, 0)
        policy.end_step()
    assert policy.num_draft_slots(req) == 0 and policy.is_paused("r")
    for _ in range(8):
        policy.end_step()
    assert policy.num_draft_slots(req) > 0  # retries after the pause


def test_opt_out_and_fixed_length():
    req = Request("r", [1], SamplingParams(speculate=False), frozenset())
    assert SpecPolicy(SpeculativeConfig(method="ngram"), 0.0, StepCosts.linear(0.05)).num_draft_slots(req) == 0
    fixed = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=3, adaptive=False), 0.0, StepCosts.linear(9.0))
    assert fixed.num_draft_slots(request()) == 3


def test_a_probe_after_a_pause_that_misses_pauses_again_at_once():
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 0.0, StepCosts.linear(0.05))
    req = request()
    while policy.num_draft_slots(req):
        policy.record(req, 4, 0)
        policy.end_step()
    for _ in range(8):
        policy.end_step()
    assert policy.num_draft_slots(req) > 0  # the probe
    policy.record(req, 4, 0)
    policy.end_step()
    assert policy.is_paused("r") and policy.states["r"].classes[0].pause_len == 32


def test_a_costly_drafter_probes_with_one_draft_and_one_lucky_hit_does_not_restart_it():
    # Drafts cost 0.4 of a step each and are right 10% of the time: they never pay.
    policy = SpecPolicy(SpeculativeConfig(method="early_exit", num_speculative_tokens=3), 0.4, StepCosts.linear(0.0))
    req = request()
    policy.num_draft_slots(req)
    for i in range(100):  # a long record over all requests of the class
        policy.record(req, 1, int(i % 10 == 0))
        policy.end_step()
    assert policy.pooled[0].rates[0] < 0.2
    st = policy.states["r"].classes[0]
    policy.num_draft_slots(req)
    while policy.is_paused("r"):
        policy.end_step()
    assert st.probing and policy.num_draft_slots(req) == 1  # the probe: one draft, whatever the estimate
    policy.record(req, 1, 1)  # it happens to be accepted ...
    policy.end_step()
    assert policy.num_draft_slots(req) == 0  # ... but the class's record still says drafts do not pay
    assert st.paused_until == policy.step + 8  # and the hit shortened the pause: the next probe comes soon


def test_context_classes_keep_their_own_statistics_and_pool_across_requests():
    klass = {"r": 1, "t": 3}
    policy = SpecPolicy(
        SpeculativeConfig(method="ngram", num_speculative_tokens=8), 0.0, StepCosts.linear(0.05),
        context_class=lambda r: klass.get(r.request_id),
    )
    req = request()
    for _ in range(30):  # short matches miss ...
        if policy.num_draft_slots(req):
            policy.record(req, 8, 0)
        policy.end_step()
    assert policy.num_draft_slots(req) == 0 and policy.is_paused("r")
    klass["r"] = 5  # ... a long match in the same request still drafts
    assert policy.num_draft_slots(req) > 0 and not policy.is_paused("r")
    for _ in range(20):
        policy.record(req, policy.num_draft_slots(req), 8)
    assert policy.num_draft_slots(req) == 8
    # A new request starts from the rates pooled over earlier ones.
    other = Request("s", [1], SamplingParams(), frozenset())
    klass["s"] = 5
    assert policy.num_draft_slots(other) >= 6 > policy.num_draft_slots(Request("t", [1], SamplingParams(), frozenset()))
    klass["s"] = None  # the drafter has nothing to propose
    assert policy.num_draft_slots(other) == 0 and not policy.is_paused("s")


def test_a_nonlinear_cost_table_moves_the_choice():
    rates = [0.3] * 8
    cheap_then_steep = StepCosts((1, 5, 6, 9), (1.0, 1.0, 2.0, 2.0))  # 1-4 drafts free, then a step
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=8), 0.0, cheap_then_steep)
    policy.pooled[0] = ClassState(rates, tested=8)  # as if earlier requests had measured them
    assert policy.num_draft_slots(request()) == 4  # free drafts up to 4, then a step that doubles the cost


def test_step_costs_interpolate_and_extrapolate():
    t = StepCosts((1, 5, 17), (1.0, 1.2, 2.4))
    assert t(1) == 1.0 and t(3) == pytest.approx(1.1) and t(11) == pytest.approx(1.8) and t(29) == pytest.approx(3.6)
    assert t.verify(4, 1) == pytest.approx(1.2)
    assert t.verify(4, 5) == pytest.approx(1 + (t(9) - 1.2) * 5 / 1.2)


def test_drafting_that_pays_alone_stops_in_a_compute_bound_batch():
    costs = StepCosts((1, 5, 17, 33), (1.0, 1.05, 2.0, 4.0))  # cheap extra tokens at batch 1, not at 16
    policy = SpecPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4), 0.0, costs)
    policy.pooled[0] = ClassState([0.6] * 4, tested=4)
    policy.begin_step(1)
    assert policy.num_draft_slots(request()) == 4
    policy.begin_step(16)
    assert policy.num_draft_slots(Request("s", [1], SamplingParams(), frozenset())) == 0
