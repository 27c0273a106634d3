"""How many drafts each request gets this step: the speculation policy. No torch.

The decision uses only what is already known before drafting (the request's
past acceptance, the measured costs), never the drafted tokens themselves, so
it is non-anticipating and verification stays exact.

Cost model, in target decode steps: a round with ``g`` drafts costs
``1 + f + g * (c + v)``, where ``c`` is the drafter's cost per token, ``v`` the
extra cost of one more token in the verification pass and ``f`` the fixed
extra cost of verifying at all (measured at start-up: on a CPU a pass over two
tokens costs noticeably more than over one). It emits
``1 + a_1 + ... + a_g`` tokens on average, ``a_i`` being the probability that
the first ``i`` drafts are all accepted (the survival form of the reference;
acceptance is far from i.i.d. for prompt lookup, where a draft that starts
right tends to stay right). Each request keeps an estimate of the conditional
acceptance ``r_i = P(draft i accepted | drafts before it accepted)``, so
``a_i = r_1 * ... * r_i``. The policy picks the ``g`` in ``1..k`` with the best
tokens per cost; when even that is below 1 the request stops drafting for a
while, then retries.
"""

from dataclasses import dataclass, field

from engine.config import SpeculativeConfig
from engine.request import Request

PRIOR_ACCEPTANCE = 0.5  # acceptance assumed before a request has any history
EMA = 0.3  # weight of the newest round in each acceptance estimate
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


@dataclass
class SpecState:
    """One request's speculation record."""

    rates: list[float] = field(default_factory=list)  # conditional acceptance per draft position
    paused_until: int = 0  # step index before which the request does not draft
    pause_len: int = MIN_PAUSE
    probing: bool = False  # first round after a pause: a miss pauses again at once
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


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig, draft_cost: float, verify_cost: float, fixed_cost: float = 0.0):
        self.config = config
        self.c = draft_cost
        self.v = verify_cost
        self.f = fixed_cost
        self.step = 0
        self.states: dict[str, SpecState] = {}

    def state(self, request: Request) -> SpecState:
        return self.states.setdefault(request.request_id, SpecState())

    def num_draft_slots(self, request: Request) -> int:
        """Drafts to verify for ``request`` this step (0: plain decoding)."""
        if not request.params.speculate:
            return 0
        k = self.config.num_speculative_tokens
        if not self.config.adaptive:
            return k
        st = self.state(request)
        if self.step < st.paused_until:
            return 0
        if len(st.rates) < k:
            st.rates.extend([PRIOR_ACCEPTANCE] * (k - len(st.rates)))
        gamma, gain = best_gamma(st.rates, self.c, k, self.v, fixed=self.f)
        if gain >= 1.0:
            return gamma
        self._pause(st)
        return 0

    def _pause(self, st: SpecState) -> None:
        st.paused_until = self.step + st.pause_len
        st.pause_len = min(2 * st.pause_len, MAX_PAUSE)
        st.rates = []  # the retry after the pause starts from the prior ...
        st.probing = True  # ... for one round only, unless it accepts something

    def is_paused(self, request_id: str) -> bool:
        st = self.states.get(request_id)
        return st is not None and self.step < st.paused_until

    def record(self, request: Request, num_drafted: int, num_accepted: int) -> None:
        """After verification: ``num_accepted`` of ``num_drafted`` drafts were kept."""
        if num_drafted == 0:
            return
        st = self.state(request)
        st.num_drafts += 1
        st.num_draft_tokens += num_drafted
        st.num_accepted_tokens += num_accepted
        if len(st.rates) < num_drafted:
            st.rates.extend([PRIOR_ACCEPTANCE] * (num_drafted - len(st.rates)))
        tested = min(num_accepted + 1, num_drafted)  # positions whose accept test ran
        for i in range(tested):
            st.rates[i] = (1 - EMA) * st.rates[i] + EMA * (i < num_accepted)
        if num_accepted > 0:
            st.pause_len = MIN_PAUSE
            st.probing = False
        elif st.probing:
            self._pause(st)

    def end_step(self) -> None:
        self.step += 1

    def free(self, request_id: str) -> SpecState | None:
        return self.states.pop(request_id, None)
