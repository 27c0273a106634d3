"""The step-cost table recalibrated online from observed decode steps."""

import pytest

from engine.config import SpeculativeConfig
from engine.spec_decode import cost_tracker
from engine.spec_decode.cost_tracker import ALPHA, CostTracker
from engine.sampling_params import SamplingParams
from engine.spec_decode.policy import StepCosts

START = StepCosts((1, 5, 17), (1.0, 1.2, 2.0), one_token_s=0.010)  # 10 ms, 12 ms, 20 ms


@pytest.fixture
def no_revert(monkeypatch):
    """The drift rule alone, without the pull back to the start-up costs."""
    monkeypatch.setattr(cost_tracker, "REVERT", 0.0)


def test_an_observation_on_a_row_moves_it_and_every_row_above_alike(no_revert):
    t = CostTracker(START)
    table = t.observe(5, 0.024)  # twice the 12 ms predicted for 5 rows
    assert t.seconds == pytest.approx([0.010, 0.012 * (1 + ALPHA), 0.020 * (1 + ALPHA)])
    assert table.costs == pytest.approx((1.0, 1.2 * (1 + ALPHA), 2.0 * (1 + ALPHA)))


def test_an_observation_between_rows_moves_the_row_below_by_interpolation_weight(no_revert):
    t = CostTracker(START)
    t.observe(11, 0.016 * 1.5)  # halfway between 5 and 17 rows (16 ms predicted), 1.5x
    assert t.seconds == pytest.approx([0.010, 0.012 * (1 + ALPHA * 0.25), 0.020 * (1 + ALPHA * 0.5)])


def test_one_row_steps_slower_than_timed_keep_the_relative_costs_of_the_rows_above():
    """Batch 1: every plain step lands on row 1. Served steps 1.5x the start-up time
    leave drafts as dear, relative to a step, as timed; they fell to 1.0 when the
    rows above kept their start-up seconds."""
    t = CostTracker(START)
    for _ in range(300):
        table = t.observe(1, 0.015)
    assert table.one_token_s == pytest.approx(0.015, rel=0.01)
    assert table.costs == pytest.approx(START.costs, rel=0.01)


def test_verification_getting_dearer_raises_the_relative_costs():
    """Observed steps at 5 rows twice as slow as timed, one-row steps as timed: drafts now
    cost more (within 5% of the observed 2.4: the pull back to the timed 1.2)."""
    t = CostTracker(START)
    for _ in range(200):
        t.observe(1, 0.010)
        table = t.observe(5, 0.024)
    assert table(5) == pytest.approx(2.4, rel=0.05)
    assert table.verify(4, batch=1) > START.verify(4, batch=1)


def test_an_entry_pushed_up_relaxes_to_the_start_up_cost_while_no_step_reaches_it():
    """Slow verifying steps push 5 rows to ~2x a step; then only one-row steps come (the
    policy stopped drafting): the entry goes back towards the timed 1.2 instead of
    keeping drafts priced out for good."""
    t = CostTracker(START)
    for _ in range(100):
        t.observe(5, 0.024)
    assert t.table()(5) > 2.0
    for _ in range(1500):
        table = t.observe(1, 0.010)
    assert table(5) == pytest.approx(1.2, rel=0.05)


def test_a_slow_outlier_moves_an_entry_by_at_most_alpha_and_the_table_stays_monotone():
    t = CostTracker(START)
    table = t.observe(1, 5.0)  # a 5 s hiccup on a 10 ms step
    assert t.seconds[0] == pytest.approx(0.010 * (1 + ALPHA))
    assert list(table.costs) == sorted(table.costs) and table.costs[0] == 1.0


def test_an_untimed_table_is_refused():
    with pytest.raises(ValueError):
        CostTracker(StepCosts.linear(0.05))


def test_the_engine_recalibrates_a_timed_table_and_leaves_a_pinned_one(make_engine, tiny_model):
    model = tiny_model()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    timed = make_engine(model, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    start = timed.speculator.policy.step_costs
    timed.add_request("a", [5, 6, 7, 5, 6, 7, 5, 6], params)
    while timed.has_unfinished():
        timed.step()
    assert timed.speculator.cost_tracker.num_observed > 0
    assert timed.speculator.policy.step_costs != start
    pinned = make_engine(model, speculative=SpeculativeConfig(method="ngram", verify_cost=0.05))
    before = pinned.speculator.policy.step_costs
    pinned.add_request("b", [5, 6, 7, 5, 6, 7, 5, 6], params)
    while pinned.has_unfinished():
        pinned.step()
    assert pinned.speculator.cost_tracker is None and pinned.speculator.policy.step_costs == before


def test_the_fixed_policy_measures_no_step_costs(make_engine, tiny_model, monkeypatch):
    """``adaptive: false`` prices nothing: the engine starts without timing a single pass,
    and plans num_speculative_tokens drafts for every decoding request each step."""
    from engine.spec_decode import speculator

    def refuse(*args, **kw):
        raise AssertionError("the step costs were measured")

    monkeypatch.setattr(speculator, "measure_step_costs", refuse)
    with pytest.raises(AssertionError, match="measured"):
        make_engine(tiny_model(), speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    fixed = make_engine(tiny_model(vocab_size=64), speculative=SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, adaptive=False))
    assert fixed.speculator.cost_tracker is None
    planned, drafted, plan = [], [], fixed.speculator.policy.plan
    fixed.speculator.policy.plan = lambda *a: planned.append(p := plan(*a)) or p
    fixed.stat_loggers.append(lambda s: drafted.append(s.spec.num_draft_tokens))
    prompt = list(range(64)) * 2  # every token has occurred: prompt lookup always proposes
    fixed.add_request("a", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    while fixed.has_unfinished():
        fixed.step()
    assert {n for p in planned for n in p.num_draft_tokens.values()} == {3} and sum(drafted) > 0


def test_a_verifying_step_moves_the_table_by_its_pass_and_the_fixed_cost_by_its_rule():
    t = CostTracker(START)
    table = t.observe(5, 0.017, verify_s=0.005)  # 12 ms for the pass of 5 rows (as predicted) + 5 ms of rule
    assert t.seconds == pytest.approx([0.010, 0.012, 0.020])
    assert table.verify_fixed == pytest.approx(ALPHA * 0.005 / 0.010)
    for _ in range(300):
        table = t.observe(5, 0.017, verify_s=0.005)
    assert table.verify_fixed == pytest.approx(0.5, rel=0.01)
    assert t.seconds == pytest.approx([0.010, 0.012, 0.020])
    table = t.observe(1, 0.010)  # a plain step leaves the fixed cost
    assert table.verify_fixed == pytest.approx(0.5, rel=0.01)


def test_verifying_steps_correct_the_rows_above_one_at_batch_1():
    """Timed at start-up at 2.0 x one row, passes of 17 rows take 1.6 x once served:
    at batch 1 only verifying steps reach those rows, and they bring the entry down."""
    t = CostTracker(START)
    for _ in range(300):
        t.observe(1, 0.010)
        table = t.observe(17, 0.0165, verify_s=0.0005)
    assert table(17) == pytest.approx(1.6, rel=0.02)
    assert table.verify_fixed == pytest.approx(0.05, rel=0.01)


def test_rows_above_the_observed_ones_drift_with_them_so_drafts_keep_their_price():
    """Plain steps at the largest batch (16 rows here) slower than timed: the entry above
    it, which no plain step reaches, moves with it, so rows beyond stay as dear as timed."""
    t = CostTracker(StepCosts((1, 5, 17, 33), (1.0, 1.2, 2.0, 3.2), one_token_s=0.010))
    for _ in range(300):
        t.observe(1, 0.010)
        table = t.observe(16, 0.030)  # 1.5x the ~19.3 ms timed for 16 rows
    assert table(16) == pytest.approx(3.0, rel=0.05)
    assert 1.4 * 1.2 < table(33) - table(17) < 1.7 * 1.2  # the timed slope, drifted about 1.5x
    assert table.verify(8, batch=16) > 1.5
