"""Per-step statistics handed to stat loggers (the Prometheus adapter is one),
and the start-up measurement of the verification cost used by the policy."""

import time
from dataclasses import dataclass, field

import torch

from engine.attention import SeqSpec
from engine.spec_policy import StepCosts


@dataclass(frozen=True)
class StepTimes:
    draft_s: float  # scheduling + drafting
    execute_s: float  # target pass + sampling / verification
    step_s: float


@dataclass(frozen=True)
class SpecStepStats:
    num_drafts: int  # requests that verified at least one draft
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]  # [k]: accepted drafts at each position
    tokens_per_round: tuple[int, ...]  # tokens emitted by each drafting request
    num_paused: int  # requests whose drafting is paused
    num_fallbacks: int = 0  # 1 when the drafter failed this step and its requests decoded plainly


@dataclass(frozen=True)
class StepStats:
    times: StepTimes
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions_total: int
    num_scheduled_tokens: int  # committed tokens computed (prompt chunks + last tokens), drafts not counted
    num_scheduled_requests: int
    num_generated_tokens: int
    num_prefix_cache_queries: int = 0  # tokens of the requests admitted this step (prefix caching on)
    num_prefix_cache_hits: int = 0  # of those, tokens found in the prefix cache
    finished: tuple = ()  # (request_id, finish_reason) ended this step
    first_token_times: tuple[tuple[float, float], ...] = ()  # (queue s, prefill s) of first tokens this step
    spec: SpecStepStats | None = None
    extra: dict = field(default_factory=dict)

    @property
    def is_decode_only(self) -> bool:
        """No prompt token was computed: every request decoded (and verified drafts)."""
        return self.num_scheduled_tokens == self.num_scheduled_requests


def make_step_stats(engine, scheduled, result, touched, times: StepTimes) -> StepStats:
    spec = None
    if engine.policy is not None:
        k = engine.config.speculative.num_speculative_tokens
        per_pos = [0] * k
        for acc in result.num_accepted.values():
            for i in range(acc):
                per_pos[i] += 1
        spec = SpecStepStats(
            num_drafts=len(result.num_drafted),
            num_draft_tokens=sum(result.num_drafted.values()),
            num_accepted_tokens=sum(result.num_accepted.values()),
            accepted_per_pos=tuple(per_pos),
            tokens_per_round=tuple(len(result.sampled[r]) for r in result.num_drafted),
            num_paused=sum(engine.policy.is_paused(r) for r in engine.scheduler.requests),
            num_fallbacks=engine.step_fallbacks,
        )
    sched = engine.scheduler
    return StepStats(
        times=times,
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        kv_usage=engine.kv_manager.usage(),
        num_preemptions_total=sched.num_preemptions,
        num_scheduled_tokens=scheduled.num_tokens,
        num_scheduled_requests=len(scheduled.scheduled),
        num_generated_tokens=sum(len(v) for v in result.sampled.values()),
        num_prefix_cache_queries=scheduled.num_prefix_cache_queries,
        num_prefix_cache_hits=scheduled.num_prefix_cache_hits,
        finished=tuple((r.request_id, r.finish_reason) for r in touched if r.is_finished),
        first_token_times=tuple(
            (r.first_scheduled_time - r.arrival_time, r.first_token_time - r.first_scheduled_time)
            for r in touched
            if r.num_output_tokens == len(result.sampled.get(r.request_id, ())) and r.first_scheduled_time and r.first_token_time is not None
        ),
        spec=spec,
    )


@torch.inference_mode()
def measure_step_costs(model, runner, max_rows: int, block_size: int, max_len: int, repeats: int = 6) -> StepCosts:
    """``T(R)`` for ``R`` = 1, 2, 3, 5, 9, 17, 33, ... up to ``max_rows`` tokens in one pass.

    Times passes of one request over ``R`` new tokens after 256 tokens of
    context, with logits for every row as verification needs, in the (still
    empty) KV cache. Call before serving.
    """
    device = runner.device
    max_rows = max(2, min(max_rows, max_len - 1))
    context = max(1, min(256, max_len - max_rows))
    blocks = list(range(-(-(context + max_rows) // block_size)))
    ids = torch.randint(0, model.config.vocab_size, (context + max_rows,), device=device)

    def run(n: int) -> float:
        meta = runner.attention.build_metadata([SeqSpec(context, n, blocks)], block_size, device)
        pos = torch.arange(context, context + n, device=device)
        t = time.perf_counter()
        model.compute_logits(model(ids[context : context + n], pos, meta, runner.kv)).argmax(-1)
        return time.perf_counter() - t

    meta = runner.attention.build_metadata([SeqSpec(0, context, blocks)], block_size, device)
    model(ids[:context], torch.arange(context, device=device), meta, runner.kv)
    rows = sorted({r for r in (1, 2, 3, 5, 9, 17, 33, 65, 129, 257) if r < max_rows} | {max_rows})
    # Interleaved, and the minimum of each: robust to other work on a shared machine.
    times = [[run(r) for r in rows] for _ in range(repeats)]
    best = [min(t[i] for t in times) for i in range(len(rows))]
    # More rows never cost less: a slow outlier at some R is capped by the larger R after it.
    costs = [max(1.0, min(best[i:]) / best[0]) for i in range(len(rows))]
    return StepCosts(tuple(rows), tuple(costs), one_token_s=best[0])
