"""How many drafts each request gets this step: the speculation policy. No torch.

A step's plan is a pure function of what was recorded before the step::

    candidates = [Candidate(id, context class, isolated), ...]   # asked before scheduling
    plan = policy.plan(candidates, num_running)                 # changes no state
    scheduler.schedule(plan.num_draft_tokens)                    # {request id: slots}
    ... draft, verify ...
    policy.record(id, plan.decisions[id], num_draft_tokens, num_accepted)  # requests that ran
    policy.end_step(plan)

Only ``record`` and ``end_step`` change the policy's state. A request planned but
then not run (preempted, or out of budget) records nothing: its decision,
a pause included, is simply made again at its next step.

The decision uses only what is known before drafting (past acceptance, the
measured costs, and a class of the request's committed context that the
drafter names, such as prompt lookup's suffix-match length), never the drafted
tokens themselves, so it is non-anticipating and verification stays exact.

Cost model, in target decode steps: a round with ``g`` drafts costs
``V(g) + g * c``, where ``c`` is the drafter's cost per token and ``V`` the
cost of verifying ``g`` drafts (``V(0) = 1``). ``V`` comes from ``T(R)``, the
time of a target pass over ``R`` tokens, measured at start-up; it is far from
linear (on a CPU, padded kernels make 1 to ~8 extra tokens nearly free, and a
large batch is compute-bound). With ``n`` requests decoding, a request's share
of a plain step is ``T(n) / n``, and ``g`` drafts add ``T(n + g) - T(n)``::

    V(g) = 1 + (T(n + g) - T(n)) * n / T(n)

so drafting that pays at batch 1 stops paying as the batch grows (the drafts
granted earlier in a step count in ``T`` for the requests after them). A pass
that verifies anything also costs a fixed ``F`` beyond its rows (the tracked
table's ``verify_fixed``, in one-token passes): the first request that drafts in
a step bears it (``F * n / T(n)`` more in its ``V``), the later ones pay their
rows only. Each decision so pays its own way, and the step's drafts pay as a
whole. (No veto of the step as a whole after the decisions: a vetoed request
drafts nothing, so its record never changes and it can stay vetoed for good.)

A round emits ``1 + a_1 + ... + a_g`` tokens on average, ``a_i`` being the
probability that the first ``i`` drafts are all accepted (the survival form of
the reference; acceptance is far from i.i.d. for prompt lookup, where a draft
that starts right tends to stay right).

Estimates of the conditional acceptance ``r_i = P(draft i accepted | drafts
before it accepted)``, so that ``a_i = r_1 * ... * r_i``, are kept per request
and per context class (a 5-token suffix match predicts far better than a
1-token one), starting from the rates pooled over all requests of that class.
The policy picks the ``g`` in ``1..num_speculative_tokens`` with the best tokens per
cost. A round is drafted only when that gain is at least ``MIN_GAIN``, a little over 1
(a round that merely breaks even by estimated rates and costs risks a loss and wins
nothing). When the request's own record is below it, the rates pooled over all requests
of the class (a slower average) have a second say: if drafting pays by them,
the request drafts as they advise: the request's record, a 0.3-weight average,
wanders far from a steady rate (at a first-draft acceptance of 0.4, four misses
in a row take it to 0.1, below paying), and a pause is long to undo. When
neither pays, that class of the request stops drafting for a while, then
retries with a probe round. A request new to a class starts with the pause
length the class has over all requests (doubled by each probe that missed,
halved by each round that accepted), so that under steady load a drafter that
does not pay, such as early exit on chat, is not probed again by every new
request.

Planning itself pauses at batch sizes whose plans keep granting nothing
(``engine.spec_decode.batch_pause``).

A seeded request is *isolated*: its record starts from the prior, never from
the pooled rates; its drafts are priced as if it were alone (``V`` at batch 1)
by the start-up cost table (``pinned_costs``), never by the one that the
engine's steps keep moving (``engine.spec_decode.cost_tracker``); and its pauses
run on its own steps, not on the engine's (which count steps it did not run).
Its choices then depend only on its own history, so it draws the same
random numbers, and writes the same tokens, whatever the server served before
or beside it. The number of drafts has to be pinned this way: under the
rejection rule, a seeded request's output does depend on it (a token emitted
as an accepted draft and the same position's bonus token use different
randomness), however the random numbers are keyed.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.utils import tree
from engine.config import SpeculativeConfig
from engine.spec_decode import tree_policy
from engine.spec_decode.batch_pause import BatchPauses
from engine.spec_decode.step_costs import StepCosts

PRIOR_ACCEPTANCE = 0.5  # acceptance assumed before a request has any history
EMA = 0.3  # weight of the newest round in a request's acceptance estimate
POOLED_EMA = 0.05  # ... and in the estimate pooled over all requests (a plain mean over its first 20 rounds)
# The gain a round must promise to be drafted: by the measured costs a round that only breaks
# even pays nothing, and the costs and rates it is priced by are estimates.
MIN_GAIN = 1.03
MIN_PAUSE, MAX_PAUSE = 8, 256  # steps a request stops drafting after drafts did not pay


@dataclass
class ClassState:
    """A request's acceptance record within one context class."""

    rates: list[float]  # conditional acceptance per draft position
    tested: int = 0  # positions tested so far; the rates past them are extrapolated flat
    paused_until: int = 0  # step index before which this class does not draft
    # Steps of the next pause. Pooled: the first pause of a request new to the class, doubled
    # by each probe that misses and halved by each round that accepts, over all requests.
    pause_len: int = MIN_PAUSE
    probing: bool = False  # first round after a pause: a miss pauses again at once
    siblings: list[list[float]] = field(default_factory=list)  # token trees: rank >= 1 rates per depth (tree_policy)
    rounds: int = 0  # rounds recorded (the pooled record's learning rate)

    def estimate(self) -> list[float]:
        """The rates, with each untested position taking the last tested one's rate (a
        run of accepted drafts tends to go on: prompt lookup's copies do)."""
        t = self.tested
        return self.rates[:t] + [self.rates[t - 1]] * (len(self.rates) - t) if t else self.rates

    def update(self, num_draft_tokens: int, num_accepted: int, weight: float) -> None:
        tested = min(num_accepted + 1, num_draft_tokens)  # positions whose accept test ran
        for i in range(tested):
            self.rates[i] = (1 - weight) * self.rates[i] + weight * (i < num_accepted)
        self.tested = max(self.tested, tested)


@dataclass
class SpecState:
    """One request's speculation record."""

    classes: dict[int, ClassState] = field(default_factory=dict)
    isolated: bool = False  # seeded: own record only, priced as if alone (see the module docstring)
    num_steps: int = 0  # steps recorded (those the request ran): an isolated request's pause clock
    last_class: int | None = None  # class of the latest decision
    num_drafts: int = 0  # rounds that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    per_step_drafted: list[int] = field(default_factory=list)  # per verified round (server.spec_stats)
    per_step_accepted: list[int] = field(default_factory=list)

    def add_round(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Counts a verified round (none when nothing was drafted)."""
        if num_draft_tokens:
            self.num_drafts += 1
            self.num_draft_tokens += num_draft_tokens
            self.num_accepted_tokens += num_accepted
            self.per_step_drafted.append(num_draft_tokens)
            self.per_step_accepted.append(num_accepted)

    def summary(self) -> dict:
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": round(mean, 4),
            "per_step_drafted": list(self.per_step_drafted),
            "per_step_accepted": list(self.per_step_accepted),
        }


@dataclass(frozen=True)
class Candidate:
    """A decoding request the policy plans for: plain data, asked of the drafter before scheduling."""

    request_id: str
    context_class: int | None  # the drafter's class of its committed context; None: nothing to propose
    isolated: bool = False  # seeded: its own record only, priced as if alone (see the module docstring)
    trees: bool = True  # may get a token tree (False under a grammar: speculator.cut_to_grammar cuts chains only)


@dataclass(frozen=True)
class Decision:
    """The plan for one request; ``record`` applies it once the request has run."""

    num_draft_tokens: int
    context_class: int | None
    pause: bool = False  # drafts do not pay: the class stops drafting for a while
    isolated: bool = False  # the candidate's ``isolated``
    # The class record to start from when the request has none yet (the pooled rates as
    # they were at planning time); None when it has one.
    fresh: ClassState | None = None
    template: tuple[int, ...] | None = None  # a token tree's shape (engine.spec_decode.tree_policy); None: a chain


@dataclass(frozen=True)
class StepPlan:
    decisions: dict[str, Decision]
    batch: int = 0  # decoding requests of the step

    @property
    def num_draft_tokens(self) -> dict[str, int]:
        """Request id -> draft slots, for the requests that draft: what the scheduler takes."""
        return {rid: d.num_draft_tokens for rid, d in self.decisions.items() if d.num_draft_tokens}

    @property
    def isolated(self) -> frozenset[str]:
        """The requests that draft and are isolated: the scheduler never cuts their slots."""
        return frozenset(rid for rid, d in self.decisions.items() if d.num_draft_tokens and d.isolated)


class SpecPolicy:
    """The adaptive policy (``adaptive: true``; ``engine.spec_decode.fixed_policy`` is the
    other). ``step_costs``: ``T(R)`` of the target; ``draft_cost``: the drafter's cost per token."""

    def __init__(self, config: SpeculativeConfig, draft_cost: float, step_costs: StepCosts):
        self.config = config
        self.c = draft_cost
        self.step_costs = step_costs
        # The start-up table, which seeded requests are priced by whatever the tracker
        # later sets ``step_costs`` to; their V at batch 1, computed once.
        self.pinned_costs = step_costs
        self._pinned_verify: list[float] | None = None
        self.step = 0
        self.states: dict[str, SpecState] = {}
        self.pooled: dict[int, ClassState] = {}  # class -> rates over all requests
        self.batch_pauses = BatchPauses()
        static = config.static_tree()
        self.static = [tree_policy.Candidate.of(static)] if static else []

    def _verify_costs(self, batch: int, rows: int, alone: bool) -> list[float]:
        """``V(n)`` for n = 0 .. the most drafts a round may have (chain or tree), for a
        request of a step with ``batch`` decoding requests and ``rows`` tokens so far (the
        drafts granted before it counted; ``alone``: as if at batch 1); computed once per
        (batch, rows) while the table stays (most steps grant no drafts, so one computation
        serves every request), for both ``_best_chain`` and ``_best_tree``."""
        if alone:
            if self._pinned_verify is None:
                self._pinned_verify = self._verify_at(self.pinned_costs, 1, 1)
            return self._pinned_verify
        key = (batch, rows)
        v = self._verify_memo.get(key)
        if v is None:
            v = self._verify_memo[key] = self._verify_at(self._step_costs, batch, rows)
        return v

    def _verify_at(self, costs: StepCosts, batch: int, rows: int) -> list[float]:
        most = max(self.config.num_speculative_tokens, len(self.static[0].template) if self.static
                   else self.config.max_tree_nodes if self.config.tree_width > 1 else 0)
        v = costs.verify_at(range(most + 1), batch, rows)
        if batch == rows:  # no drafts in the pass yet: these would bear its fixed cost
            fixed = costs.verify_fixed * batch / costs(batch)
            v = v[:1] + [x + fixed for x in v[1:]]
        return v

    @property
    def step_costs(self) -> StepCosts:
        return self._step_costs

    @step_costs.setter
    def step_costs(self, costs: StepCosts) -> None:
        self._step_costs = costs
        self._verify_memo: dict[tuple[int, int], list[float]] = {}  # (batch, rows) -> _verify_costs

    def _best_chain(self, rates: list[float], most: int, v: list[float]) -> tuple[int, float]:
        """``(g, gain)``: the num_draft_tokens g in 1..most with the most tokens per step of
        cost, ``(1 + a_1 + ... + a_g) / (V(g) + g c)`` (the shortest on ties), in one pass
        over g; ``v``: ``_verify_costs``."""
        best, accepted, survive = (0, 0.0), 0.0, 1.0
        for g in range(1, most + 1):
            survive *= rates[g - 1]
            accepted += survive
            gain = (1 + accepted) / (v[g] + g * self.c)
            if gain > best[1]:
                best = (g, gain)
        return best

    def _best_tree(self, rates, siblings, v: list[float]) -> tuple[tuple[int, ...], float]:
        """``(template, gain)``: the static tree, else the best grown one (``tree_policy``);
        ``v``: ``_verify_costs``."""
        nodes = len(self.static[0].template) if self.static else self.config.max_tree_nodes
        v = v[: nodes + 1]
        if self.static:
            depth = max(self.static[0].depths) + 1
            return tree_policy.best(self.static, rates, siblings, lambda n: v[n] + depth * self.c)
        most, w = self.config.num_speculative_tokens, self.config.tree_width
        return tree_policy.best_grown(rates, siblings, most, w, v, self.c)

    def plan(self, candidates: Sequence[Candidate], num_running: int) -> StepPlan:
        """Draft slots for each candidate (0: plain decoding; a chain's length or a tree's
        node count), in order, with ``num_running`` requests in the step. Pure: reads the
        records, changes nothing."""
        batch = rows = max(1, num_running)
        shared_planned = self.plans_shared(num_running)
        decisions = {}
        # Isolated requests first: priced alone, they draft whatever the others do, and
        # when they do, the pass verifies anyway and the others do not bear its fixed cost.
        for c in sorted(candidates, key=lambda c: not c.isolated):
            if not (shared_planned or c.isolated):
                continue
            d = self._decide(c, batch, rows)
            rows += d.num_draft_tokens
            decisions[c.request_id] = d
        return StepPlan(decisions, batch)

    def plans_shared(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` decoding requests plans the requests priced
        within the batch (isolated ones are always planned); False while their bucket is
        paused after idle plans."""
        if self.step_costs.per_request:
            return True
        return self.batch_pauses.plans(self.step, num_running)

    def _decide(self, c: Candidate, batch: int, rows: int) -> Decision:
        key, alone = c.context_class, c.isolated
        if key is None:
            return Decision(0, None, isolated=alone)
        most = self.config.num_speculative_tokens
        st = self.states.get(c.request_id)
        cs = st.classes.get(key) if st is not None else None
        fresh = None if cs is not None else self._fresh(key, alone)
        cs = cs or fresh
        if self._now(st, alone) < cs.paused_until:
            return Decision(0, key, isolated=alone)
        v = self._verify_costs(batch, rows, alone)
        num_draft_tokens, gain, template = self._best_round(cs, most, v, c.trees)
        pooled = None if alone else self.pooled.get(key)
        if gain < MIN_GAIN and pooled is not None:  # the long run's second opinion
            pooled_choice = self._best_round(pooled, most, v, c.trees)
            if pooled_choice[1] >= MIN_GAIN:
                num_draft_tokens, gain, template = pooled_choice
        if gain < MIN_GAIN:
            if not cs.probing:
                return Decision(0, key, pause=True, isolated=alone, fresh=fresh)
            num_draft_tokens, template = 1, None  # a probe after a pause: the cheapest test of whether drafts pay again
        return Decision(num_draft_tokens, key, isolated=alone, fresh=fresh, template=template)

    def _best_round(self, cs: ClassState, most: int, v: list[float], trees: bool):
        """``(drafts, gain, tree template or None)``: the best chain, or tree where allowed
        and better, by the record ``cs``; ``v``: ``_verify_costs``."""
        rates = cs.estimate()
        num_draft_tokens, gain = self._best_chain(rates, most, v)
        if trees and (self.static or self.config.tree_width > 1):
            shape, tree_gain = self._best_tree(rates, cs.siblings, v)
            if tree_gain > gain and not tree.is_chain(shape):
                return len(shape), tree_gain, shape
        return num_draft_tokens, gain, None

    def _fresh(self, key: int, isolated: bool) -> ClassState:
        """A request's first record of a class: the pooled one's rates, else (or when
        ``isolated``) the prior."""
        pooled = self.pooled.get(key)
        if pooled is None or isolated:
            return ClassState([PRIOR_ACCEPTANCE] * self.config.num_speculative_tokens)
        return ClassState(list(pooled.rates), pooled.tested, pause_len=pooled.pause_len,
                          siblings=[list(r) for r in pooled.siblings])

    def _now(self, st: SpecState | None, isolated: bool) -> int:
        """The clock a request's pauses run on: the engine's step; an isolated request's own
        steps (other traffic then neither stretches nor shortens its pauses)."""
        if not isolated:
            return self.step
        return st.num_steps if st is not None else 0

    def _pause(self, cs: ClassState, key: int, isolated: bool, now: int) -> None:
        cs.paused_until = now + cs.pause_len
        cs.pause_len = min(2 * cs.pause_len, MAX_PAUSE)
        # The retry starts from what this class does over all requests (an isolated one: the prior),
        fresh = self._fresh(key, isolated)
        cs.rates, cs.tested = fresh.rates, fresh.tested
        cs.probing = True  # with at least one draft, and one round only unless it accepts something

    def is_paused(self, request_id: str) -> bool:
        """The request's current context class does not draft for now (drafts did not pay)."""
        st = self.states.get(request_id)
        cs = st.classes.get(st.last_class) if st is not None else None
        return cs is not None and self._now(st, st.isolated) < cs.paused_until

    def record(self, request_id: str, decision: Decision, num_draft_tokens: int, num_accepted: int,
               outcomes=None) -> None:
        """After verification of a request that ran with ``decision``: ``num_accepted``
        of ``num_draft_tokens`` drafts were kept; ``outcomes``: for a token tree, what was
        tried per depth (``engine.utils.tree.walk``). The only place a request's record changes."""
        st = self.states.get(request_id)
        if st is None:
            st = self.states[request_id] = SpecState(isolated=decision.isolated)
        now = self._now(st, st.isolated)
        st.num_steps += 1
        key = st.last_class = decision.context_class
        if key is None:
            return
        cs = st.classes.get(key)
        if cs is None:
            cs = st.classes[key] = decision.fresh or self._fresh(key, st.isolated)
        if decision.pause:
            self._pause(cs, key, st.isolated, now)
        if num_draft_tokens == 0:
            return
        st.add_round(num_draft_tokens, num_accepted)
        pooled = self.pooled.setdefault(key, ClassState([PRIOR_ACCEPTANCE] * self.config.num_speculative_tokens))
        # The pooled record averages its first rounds plainly (the prior counting as one), so
        # that a class's first few dozen rounds, not the prior, decide whether it pays.
        pooled.rounds += 1
        for record, weight in ((cs, EMA), (pooled, max(POOLED_EMA, 1 / (pooled.rounds + 1)))):
            if outcomes is None:
                record.update(num_draft_tokens, num_accepted, weight)
            else:
                tested = tree_policy.update(record.rates, record.siblings, outcomes, weight)
                record.tested = max(record.tested, tested)
        if num_accepted > 0:
            cs.pause_len = MIN_PAUSE
            cs.probing = False
            pooled.pause_len = max(MIN_PAUSE, pooled.pause_len // 2)
        elif cs.probing:
            pooled.pause_len = min(2 * pooled.pause_len, MAX_PAUSE)
            self._pause(cs, key, st.isolated, now)

    def end_step(self, plan: StepPlan | None = None) -> None:
        """After the step ran with ``plan``: its bucket's record of idle plans (a plan with no
        shared candidate, such as a step of prompts only, does not count), then the next step."""
        shared = [d for d in plan.decisions.values() if not d.isolated] if plan is not None else []
        if shared:  # none while the bucket is paused
            self.batch_pauses.record(self.step, plan.batch, any(d.num_draft_tokens for d in shared))
        self.step += 1

    def free(self, request_id: str) -> SpecState | None:
        return self.states.pop(request_id, None)
