"""The fixed policy: every decoding request drafts ``num_speculative_tokens`` tokens, or
the configured tree, every step (``adaptive: false``). No torch.

It prices nothing, so the engine measures no step costs at start-up for it, and a
seeded request's draft counts (which its output depends on, see
``engine.spec_decode.policy``) are the same on every server start. It speaks the
adaptive policy's interface (``SpecPolicy``): plan, record, end_step, free.
"""

from collections.abc import Sequence

from engine.config import SpeculativeConfig
from engine.utils import tree
from engine.spec_decode.policy import Candidate, Decision, SpecState, StepPlan


class FixedPolicy:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.states: dict[str, SpecState] = {}  # per request: its rounds, for the usage summary
        most, w = config.num_speculative_tokens, config.tree_width
        # The static tree, else the widest product tree within max_tree_nodes, else chains.
        self.template = config.static_tree() or (tree.product_tree([w] * most, config.max_tree_nodes) if w > 1 else None)

    def plans_shared(self, num_running: int) -> bool:
        return True

    def plan(self, candidates: Sequence[Candidate], num_running: int) -> StepPlan:
        """The same round for every candidate with something to propose (a chain under a grammar)."""
        return StepPlan({c.request_id: self._decide(c) for c in candidates}, max(1, num_running))

    def _decide(self, c: Candidate) -> Decision:
        if c.context_class is None:
            return Decision(0, None, isolated=c.isolated)
        template = self.template if c.trees else None
        num_draft_tokens = len(template) if template else self.config.num_speculative_tokens
        return Decision(num_draft_tokens, c.context_class, isolated=c.isolated, template=template)

    def record(self, request_id: str, decision: Decision, num_draft_tokens: int, num_accepted: int,
               outcomes=None) -> None:
        st = self.states.setdefault(request_id, SpecState(isolated=decision.isolated))
        st.last_class = decision.context_class
        st.add_round(num_draft_tokens, num_accepted)

    def is_paused(self, request_id: str) -> bool:
        return False

    def end_step(self, plan: StepPlan | None = None) -> None:
        pass

    def free(self, request_id: str) -> SpecState | None:
        return self.states.pop(request_id, None)
