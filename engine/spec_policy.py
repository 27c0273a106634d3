"""How many drafts each request gets this step: the speculation policy. No torch.

The decision uses only what is known before drafting (past acceptance, the
measured costs, and a class of the request's committed context that the
drafter names, such as prompt lookup's suffix-match length), never the drafted
tokens themselves, so it is non-anticipating and verification stays exact.

Cost model, in target decode steps: a round with ``g`` drafts costs
``V(g) + g * c``, where ``c`` is the drafter's cost per token and ``V`` the
cost of a target pass verifying ``g`` drafts (``V(0) = 1``), measured at
start-up (on a CPU it is far from linear: padded kernels make 1 to ~8 drafts
nearly free). It emits ``1 + a_1 + ... + a_g`` tokens on average, ``a_i`` being
the probability that the first ``i`` drafts are all accepted (the survival form
of the reference; acceptance is far from i.i.d. for prompt lookup, where a
draft that starts right tends to stay right).

Estimates of the conditional acceptance ``r_i = P(draft i accepted | drafts
before it accepted)``, so that ``a_i = r_1 * ... * r_i``, are kept per request
and per context class (a 5-token suffix match predicts far better than a
1-token one), starting from the rates pooled over all requests of that class.
The policy picks the ``g`` in ``1..k`` with the best tokens per cost; when even
that is below 1, that class of the request stops drafting for a while, then
retries with a probe round.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import SpeculativeConfig
from engine.request import Request

PRIOR_ACCEPTANCE = 0.5  # acceptance assumed before a request has any history
EMA = 0.3  # weight of the newest round in a request's acceptance estimate
POOLED_EMA = 0.05  # ... and in the estimate pooled over all requests
MIN_PAUSE, MAX_PAUSE = 8, 256  # steps a request stops drafting after drafts did not pay


def survival(alpha, gamma: int) -> list[float]:
    """``[a_1 .. a_gamma]``: i.i.d. ``alpha ** i`` for a number, running products
    of conditional rates for a sequence (entry i: P(draft i+1 accepted | the ones before))."""
    if isinstance(alpha, (int, float)):
        return [alpha**i for i in range(1, gamma + 1)]
    out, a = [], 1.0
    for r in list(alpha)[:gamma]:
        a *= r
        out.append(a)
    return out


def expected_tokens(alpha, gamma: int) -> float:
    """Mean tokens a round emits: ``1 + a_1 + ... + a_gamma``."""
    return 1 + sum(survival(alpha, gamma))


def speedup(alpha, gamma: int, c: float, v: float = 0.0, parallel: bool = False, fixed: float = 0.0) -> float:
    """Tokens per target-step of cost: ``expected_tokens / (1 + fixed + draft cost + gamma * v)``."""
    draft_cost = c if parallel else gamma * c
    return expected_tokens(alpha, gamma) / (1 + fixed + draft_cost + gamma * v)


def best_gamma(
    alpha, c: float, max_gamma: int, v: float = 0.0, parallel: bool = False, fixed: float = 0.0
) -> tuple[int, float]:
    """``(gamma, speedup)`` with the best speedup in 1..max_gamma (smallest on ties)."""
    best = (1, speedup(alpha, 1, c, v, parallel, fixed))
    for g in range(2, max_gamma + 1):
        s = speedup(alpha, g, c, v, parallel, fixed)
        if s > best[1] + 1e-12:
            best = (g, s)
    return best


def linear_costs(k: int, per_token: float, fixed: float = 0.0) -> list[float]:
    """``[V(0) .. V(k)]`` for a pass costing ``1 + fixed + g * per_token`` with ``g >= 1`` drafts."""
    return [1.0] + [1.0 + fixed + g * per_token for g in range(1, k + 1)]


@dataclass
class ClassState:
    """A request's acceptance record within one context class."""

    rates: list[float]  # conditional acceptance per draft position
    tested: int = 0  # positions tested so far; the rates past them are extrapolated flat
    paused_until: int = 0  # step index before which this class does not draft
    pause_len: int = MIN_PAUSE
    probing: bool = False  # first round after a pause: a miss pauses again at once


    def estimate(self) -> list[float]:
        """The rates, with each untested position taking the last tested one's rate (a
        run of accepted drafts tends to go on: prompt lookup's copies do)."""
        t = self.tested
        return self.rates[:t] + [self.rates[t - 1]] * (len(self.rates) - t) if t else self.rates

    def update(self, num_drafted: int, num_accepted: int, weight: float) -> None:
        tested = min(num_accepted + 1, num_drafted)  # positions whose accept test ran
        for i in range(tested):
            self.rates[i] = (1 - weight) * self.rates[i] + weight * (i < num_accepted)
        self.tested = max(self.tested, tested)


@dataclass
class SpecState:
    """One request's speculation record."""

    classes: dict[int, ClassState] = field(default_factory=dict)
    last_class: int | None = None  # class of the latest decision
    num_drafts: int = 0  # rounds that verified at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def summary(self) -> dict:
        mean = 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "mean_acceptance_length": round(mean, 4),
        }


def _no_classes(request: Request) -> int:
    return 0


class SpecPolicy:
    """``verify_costs[g]``: cost of a pass verifying ``g`` drafts, ``g = 0 .. k``, in plain
    decode steps. ``context_class(request)``: the drafter's class of the committed
    context (an int), or None when the drafter has nothing to propose."""

    def __init__(
        self,
        config: SpeculativeConfig,
        draft_cost: float,
        verify_costs: list[float],
        context_class: Callable[[Request], int | None] = _no_classes,
    ):
        k = config.num_speculative_tokens
        if len(verify_costs) != k + 1:
            raise ValueError(f"need verify costs for 0..{k} drafts, got {len(verify_costs)}")
        self.config = config
        self.c = draft_cost
        self.costs = list(verify_costs)
        self.context_class = context_class
        self.step = 0
        self.states: dict[str, SpecState] = {}
        self.pooled: dict[int, ClassState] = {}  # class -> rates over all requests

    def state(self, request: Request) -> SpecState:
        return self.states.setdefault(request.request_id, SpecState())

    def gain(self, rates: list[float], g: int) -> float:
        """Tokens per step of cost with ``g`` drafts at conditional ``rates``."""
        return expected_tokens(rates, g) / (self.costs[g] + g * self.c)

    def num_draft_slots(self, request: Request) -> int:
        """Drafts to verify for ``request`` this step (0: plain decoding)."""
        if not request.params.speculate:
            return 0
        k = self.config.num_speculative_tokens
        key = self.context_class(request)
        st = self.state(request)
        st.last_class = key
        if key is None:
            return 0
        if not self.config.adaptive:
            return k
        cs = st.classes.get(key)
        if cs is None:
            cs = st.classes[key] = self._fresh(key)
        if self.step < cs.paused_until:
            return 0
        rates = cs.estimate()
        gamma = max(range(1, k + 1), key=lambda g: (self.gain(rates, g), -g))
        if self.gain(rates, gamma) >= 1.0:
            return gamma
        self._pause(cs)
        return 0

    def _fresh(self, key: int) -> ClassState:
        """A request's first record of a class: the pooled one's rates, else the prior."""
        pooled = self.pooled.get(key)
        if pooled is None:
            return ClassState([PRIOR_ACCEPTANCE] * self.config.num_speculative_tokens)
        return ClassState(list(pooled.rates), pooled.tested)

    def _pause(self, cs: ClassState) -> None:
        cs.paused_until = self.step + cs.pause_len
        cs.pause_len = min(2 * cs.pause_len, MAX_PAUSE)
        cs.rates = [PRIOR_ACCEPTANCE] * self.config.num_speculative_tokens  # the retry starts from the prior ...
        cs.tested = 0
        cs.probing = True  # ... for one round only, unless it accepts something

    def is_paused(self, request_id: str) -> bool:
        """The request's current context class does not draft for now (drafts did not pay)."""
        st = self.states.get(request_id)
        cs = st.classes.get(st.last_class) if st is not None else None
        return cs is not None and self.step < cs.paused_until

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """After verification: ``num_accepted`` of ``num_drafted`` drafts were kept."""
        st = self.states.get(request.request_id)
        if num_drafted == 0 or st is None or st.last_class is None:
            return
        st.num_drafts += 1
        st.num_draft_tokens += num_drafted
        st.num_accepted_tokens += num_accepted
        key = st.last_class
        cs = st.classes.setdefault(key, self._fresh(key))
        cs.update(num_drafted, num_accepted, EMA)
        pooled = self.pooled.setdefault(key, ClassState([PRIOR_ACCEPTANCE] * self.config.num_speculative_tokens))
        pooled.update(num_drafted, num_accepted, POOLED_EMA)
        if num_accepted > 0:
            cs.pause_len = MIN_PAUSE
            cs.probing = False
        elif cs.probing:
            self._pause(cs)

    def end_step(self) -> None:
        self.step += 1

    def free(self, request_id: str) -> SpecState | None:
        return self.states.pop(request_id, None)
