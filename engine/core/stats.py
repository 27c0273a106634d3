"""Per-step statistics handed to stat loggers (the Prometheus adapter is one)."""

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state at one instant, pushed by the engine thread after each step
    (``AsyncEngine.snapshot``) and read by ``/metrics``."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1 of the block pool in use
    num_preemptions: int  # since start


@dataclass(frozen=True)
class StepTimes:
    draft_s: float  # scheduling + drafting
    execute_s: float  # target pass + sampling / verification
    step_s: float


class StepClock:
    """A step's clock, started at the step's start: ``lap(value)`` ends a phase (drafting,
    then the target pass) and passes ``value`` through, so the step reads as its phases."""

    def __init__(self):
        self.marks = [time.perf_counter()]

    def lap(self, value):
        self.marks.append(time.perf_counter())
        return value

    def times(self) -> StepTimes:
        t0, t1, t2 = self.marks
        return StepTimes(t1 - t0, t2 - t1, time.perf_counter() - t0)


@dataclass(frozen=True)
class SpecStepStats:
    num_drafts: int  # requests that verified at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # accepted drafts at each position, as deep as the step's longest run
    tokens_per_round: tuple[int, ...]  # tokens emitted by each drafting request
    num_paused: int  # requests whose drafting is paused
    num_fallbacks: int = 0  # 1 when the drafter failed this step and its requests decoded plainly


@dataclass(frozen=True)
class StepStats:
    times: StepTimes
    num_scheduled_tokens: int  # committed tokens computed (prompt chunks + last tokens), drafts not counted
    num_scheduled_requests: int
    num_prefix_cache_queries: int = 0  # tokens of the requests admitted this step (prefix caching on)
    num_prefix_cache_hits: int = 0  # of those, tokens found in the prefix cache
    first_token_times: tuple[tuple[float, float], ...] = ()  # (queue s, prefill s) of first tokens this step
    spec: SpecStepStats | None = None

    @property
    def is_decode_only(self) -> bool:
        """No prompt token was computed: every request decoded (and verified drafts)."""
        return self.num_scheduled_tokens == self.num_scheduled_requests


def spec_step_stats(result, num_paused: int, num_fallbacks: int) -> SpecStepStats:
    """A step's speculation statistics from its runner output (``RunnerOutput``)."""
    per_pos = [0] * max(result.num_accepted.values(), default=0)
    for acc in result.num_accepted.values():
        for i in range(acc):
            per_pos[i] += 1
    return SpecStepStats(
        num_drafts=len(result.num_draft_tokens),
        num_draft_tokens=sum(result.num_draft_tokens.values()),
        num_accepted_tokens=sum(result.num_accepted.values()),
        accepted_per_pos=tuple(per_pos),
        tokens_per_round=tuple(len(result.sampled[r]) for r in result.num_draft_tokens),
        num_paused=num_paused,
        num_fallbacks=num_fallbacks,
    )


def make_step_stats(scheduled, result, touched, times: StepTimes, spec: SpecStepStats | None = None) -> StepStats:
    return StepStats(
        times=times,
        num_scheduled_tokens=scheduled.num_tokens,
        num_scheduled_requests=len(scheduled.scheduled),
        num_prefix_cache_queries=scheduled.num_prefix_cache_queries,
        num_prefix_cache_hits=scheduled.num_prefix_cache_hits,
        first_token_times=tuple(
            (r.first_scheduled_time - r.arrival_time, r.first_token_time - r.first_scheduled_time)
            for r in touched
            if r.num_output_tokens == len(result.sampled.get(r.request_id, ()))
            and r.first_scheduled_time and r.first_token_time is not None
        ),
        spec=spec,
    )
