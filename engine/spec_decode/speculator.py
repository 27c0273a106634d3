"""The Speculator: speculation's one owner inside the engine's step.

It holds the drafter, the speculation policy (fixed or adaptive) and, where step
costs are timed, the cost tracker, and speaks for them at three points of
``LLMEngine.step``:

- ``plan``, before scheduling: the policy's draft slots for the decoding requests,
  from the drafter's context classes of them;
- ``propose``, after scheduling: the drafter's drafts for the scheduled slots, each
  request drafted alone when the batch fails, so that one bad request costs only
  its own drafts;
- ``record``, after the scheduler's update: what was kept goes to the drafter,
  each planned request's outcome to the policy, the step's time to the cost tracker.

Without a drafter every one of them is empty: the engine steps the same way with or
without speculation. ``free`` is the release path's: a request ended.
"""

import logging

from engine.config import EngineConfig
from engine.core.request import Request
from engine.core.scheduler import RunnerOutput, SchedulerOutput
from engine.spec_decode.cost_tracker import CostTracker, measure_step_costs
from engine.spec_decode.drafter import Draft, Drafter, DraftSlot
from engine.spec_decode.fixed_policy import FixedPolicy
from engine.spec_decode.policy import Candidate, SpecPolicy, SpecState, StepPlan
from engine.spec_decode.step_costs import StepCosts
from engine.spec_decode.registry import build_drafter
from engine.core.stats import SpecStepStats, spec_step_stats
from engine.utils.tree import is_chain, walk

log = logging.getLogger(__name__)


class Speculator:
    def __init__(self, drafter: Drafter | None = None, policy=None, cost_tracker: CostTracker | None = None):
        self.drafter = drafter
        self.policy: SpecPolicy | FixedPolicy | None = policy  # None exactly when drafter is
        self.cost_tracker = cost_tracker  # None: the policy's step costs stay as they are
        self.fault_hook = None  # tests: called as hook("drafter", request_ids); see engine.utils.faults
        self.step_fallbacks = 0  # 1 when the drafter failed in the current step

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """Target layers whose features the drafter reads (``Drafter.feature_layers``)."""
        return self.drafter.feature_layers if self.drafter is not None else ()

    def plan(self, running: list[Request]) -> StepPlan:
        """Begins a step: the policy's plan for it, from the records of the steps before it
        and the drafter's context classes of the decoding requests (asked here, before
        scheduling). Changes no policy state. A request drafts once it has an output token:
        whether the step that computes its last prompt token could draft would depend on
        where the budget and the prefix cache cut its prompt, not on the request alone."""
        self.step_fallbacks = 0
        if self.policy is None:
            return StepPlan({})
        shared = self.policy.plans_shared(len(running))  # False: only seeded requests are planned
        candidates = [
            Candidate(r.request_id, self._context_class(r), isolated=r.params.seed is not None, trees=r.grammar is None)
            for r in running
            if r.params.speculate and r.num_output_tokens and r.num_computed_tokens + 1 == r.num_tokens
            and (shared or r.params.seed is not None)
        ]
        return self.policy.plan(candidates, len(running))

    def propose(self, scheduled: SchedulerOutput, plan: StepPlan, requests: dict[str, Request], block_table) -> dict:
        """Drafts for the scheduled slots (a chain, or a tree of the plan's shape);
        ``block_table(request_id)``: the target's KV blocks of a request. When the
        drafter fails, each request is rolled back and drafted alone, so that only the
        requests that fail by themselves decode without drafts this step (their drafter
        state dropped); the others keep their state and their drafts."""
        if self.drafter is None:
            return {}
        slots = [
            DraftSlot(requests[s.request_id], s.num_draft_tokens, tuple(block_table(s.request_id)),
                      plan.decisions[s.request_id].template)
            for s in scheduled.scheduled
            if s.num_draft_tokens
        ]
        if not slots:
            return {}
        try:
            return self._drafts(slots)
        except Exception:  # isolated below
            log.exception("drafter failed for %d requests; drafting them one by one", len(slots))
        self.step_fallbacks = 1
        drafts = {}
        for s in slots:
            self.drafter.rollback(s.request)
            try:
                drafts.update(self._drafts([s]))
            except Exception:  # speculation is an optimization: decode plainly instead
                log.exception("drafter failed; request %s decodes without drafts this step", s.request.request_id)
                self.drafter.free(s.request.request_id)  # its caches may be half-written
        return drafts

    def record(self, scheduled: SchedulerOutput, plan: StepPlan, result: RunnerOutput, drafts: dict,
               requests: dict[str, Request], execute_s: float) -> None:
        """After the scheduler's update: tell the drafter what was kept, record the plan of the
        requests that ran, and feed a decode step's time (``execute_s``) to the cost tracker."""
        if self.policy is None:
            return
        if result.features:
            self.drafter.add_features(result.features)
        for s in scheduled.scheduled:
            rid, draft = s.request_id, drafts.get(s.request_id)
            accepted = result.num_accepted.get(rid, 0)
            if rid in plan.decisions:
                outcomes = None
                if draft is not None and not is_chain(draft.parents) and rid in result.sampled:
                    outcomes = walk(draft.token_ids, draft.parents, result.sampled[rid][:accepted])
                self.policy.record(rid, plan.decisions[rid], result.num_draft_tokens.get(rid, 0), accepted, outcomes)
            if (req := requests.get(rid)) is not None:  # not finished
                self.drafter.commit(req)
        self.policy.end_step(plan)
        if self.cost_tracker is not None and all(len(s.token_ids) == 1 for s in scheduled.scheduled):
            rows = scheduled.num_tokens + sum(result.num_draft_tokens.values())  # decode step: last tokens + drafts
            self.policy.step_costs = self.cost_tracker.observe(rows, execute_s, result.verify_s)

    def step_stats(self, result: RunnerOutput, request_ids) -> SpecStepStats | None:
        """The step's speculation statistics (None without speculation)."""
        if self.policy is None:
            return None
        return spec_step_stats(result, sum(self.policy.is_paused(r) for r in request_ids), self.step_fallbacks)

    def summary(self, request_id: str) -> dict:
        """The request's speculation record: zero counts for a request that drew no drafts (opted
        out, finished at its prefill), so that every reply of a speculating engine carries one;
        empty without speculation."""
        if self.policy is None:
            return {}
        return (self.policy.states.get(request_id) or SpecState()).summary()

    def free(self, request_id: str) -> None:
        """The request ended: drop the drafter's and the policy's state of it."""
        if self.drafter is not None:
            self.drafter.free(request_id)
        if self.policy is not None:
            self.policy.free(request_id)

    def _drafts(self, slots: list[DraftSlot]) -> dict:
        if self.fault_hook:
            self.fault_hook("drafter", [s.request.request_id for s in slots])
        return cut_to_grammar(self.drafter.propose(slots), slots)

    def _context_class(self, request: Request) -> int | None:
        """The drafter's class of the request's context (the plan asks it); a failure
        means no drafts for this request this step, as in ``propose``."""
        try:
            if self.fault_hook:
                self.fault_hook("drafter", [request.request_id])
            return self.drafter.context_class(request)
        except Exception:  # speculation is an optimization: decode plainly instead
            log.exception("drafter failed; request %s decodes without drafts this step", request.request_id)
            self.step_fallbacks = 1
            self.drafter.free(request.request_id)
            return None


def build_speculator(config: EngineConfig, runner, drafter: Drafter | None = None, **context) -> Speculator:
    """The engine's Speculator: ``drafter`` (tests), or the one ``config.speculative`` names,
    with its policy; an adaptive policy prices drafts with ``verify_cost`` or with the step
    costs measured on ``runner`` (then tracked). ``context``: the drafter factory's
    (``engine.spec_decode.registry``) and ``max_model_len``."""
    sc = config.speculative
    if sc.method is None and drafter is None:
        return Speculator()
    max_model_len = context.pop("max_model_len")
    drafter = drafter or build_drafter(sc, target=runner.model, device=runner.device, target_kv=runner.kv,
                                       attention=runner.attention, block_size=runner.block_size, **context)
    if not sc.adaptive:  # the same round every step: nothing to price, nothing to measure
        log.info("speculation: %s, %d drafts%s every step", sc.method, sc.num_speculative_tokens,
                 " or the configured tree" if sc.uses_trees else "")
        return Speculator(drafter, FixedPolicy(sc))
    tracker = None
    if sc.verify_cost is not None:
        costs = StepCosts.linear(sc.verify_cost)
    else:
        most = config.scheduler.max_num_seqs + sc.num_speculative_tokens
        max_rows = min(config.scheduler.max_num_batched_tokens, most)
        costs = measure_step_costs(runner.model, runner, max_rows, runner.block_size, max_model_len)
        tracker = CostTracker(costs)
    log.info("speculation: %s, num_speculative_tokens=%d, draft cost %.3f per token; pass cost by tokens %s",
             sc.method, sc.num_speculative_tokens, drafter.cost_per_token,
             " ".join(f"{r}:{c:.2f}" for r, c in zip(costs.rows, costs.costs)))
    return Speculator(drafter, SpecPolicy(sc, drafter.cost_per_token, costs), tracker)


def cut_to_grammar(drafts: dict, slots: list[DraftSlot]) -> dict:
    """Each draft chain of a request with a grammar, cut at its first token outside the
    grammar (before the target pass; exact, see ``engine.worker.grammar``)."""
    for s in slots:
        rid, grammar = s.request.request_id, s.request.grammar
        if grammar is None or rid not in drafts:
            continue
        d = drafts[rid]
        n = grammar.valid_draft_prefix(d.token_ids)
        if n == 0:
            del drafts[rid]
        elif n < len(d.token_ids):
            drafts[rid] = Draft(d.token_ids[:n], None if d.probs is None else d.probs[:n])
    return drafts
