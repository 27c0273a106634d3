"""Per-step statistics: every step reaches the stat loggers, whatever it accepted."""

from engine.core.scheduler import RunnerOutput, SchedulerOutput
from engine.core.stats import StepTimes, make_step_stats, spec_step_stats


def test_accepted_per_position_counts_runs_of_any_length():
    """The per-position counts follow the step's accepted runs, not the configured most:
    counts sized by num_speculative_tokens raise IndexError on a longer run, and the engine
    leaves a step whose stats fail out of the metrics."""
    result = RunnerOutput({"a": [1, 2, 3, 4, 5], "b": [7, 8]}, num_draft_tokens={"a": 6, "b": 2},
                          num_accepted={"a": 4, "b": 1})
    stats = make_step_stats(SchedulerOutput(()), result, [], StepTimes(0.0, 0.0, 0.0), spec_step_stats(result, 0, 0))
    assert stats.spec.accepted_per_pos == (2, 1, 1, 1)
    assert stats.spec.tokens_per_round == (5, 2) and stats.spec.num_accepted_tokens == 5
