"""Tree shapes in the speculation policy: the expected accepted length of a
hand-drawn tree, the choice between trees and chains driven by the recorded
per-depth, per-rank acceptance, and the configuration keys."""

import pytest

from engine.config import SpeculativeConfig
from engine.spec_decode.policy import Candidate as Request, SpecPolicy, StepCosts
from engine.tree_policy import Candidate, expected_accepted, update


def test_expected_accepted_of_a_small_tree():
    #   root: children 0 (rank 0), 1 (rank 1); node 0: child 2
    c = Candidate.of((-1, -1, 0))
    # node 0: 0.5; node 1: (1 - 0.5) * 0.4; node 2: 0.5 * 0.9
    assert expected_accepted(c, [0.5, 0.9], [[0.4]]) == pytest.approx(0.5 + 0.2 + 0.45)


def test_update_moves_each_tried_rank_towards_its_outcome():
    rank0, siblings = [0.5, 0.5], []
    # depth 0: rank 0 rejected, rank 1 accepted; depth 1: two children tried, none accepted
    tested = update(rank0, siblings, [(2, 1), (2, None)], weight=0.5)
    assert tested == 2
    assert rank0 == [0.25, 0.25] and siblings == [[0.625], [0.125]]


def request() -> Request:
    """A decoding request as the policy sees it: its id and context class."""
    return Request("r", 0)


def decide(p: SpecPolicy, req: Request):
    """This step's decision for ``req`` alone (the plan is pure: it changes nothing)."""
    return p.plan([req], 1).decisions[req.request_id]


def policy(**kw) -> SpecPolicy:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, tree_width=3, max_tree_nodes=12, **kw)
    return SpecPolicy(config, 0.0, StepCosts.linear(0.05))


def test_siblings_that_pay_give_trees_and_siblings_that_never_do_give_chains():
    p, req = policy(), request()
    for _ in range(30):  # the first guess is usually wrong, the second usually right
        p.record("r", decide(p, req), 6, 2, outcomes=[(2, 1), (2, 1), (1, None)])
        p.end_step()
    shape = decide(p, req).template
    assert shape is not None and shape.count(-1) >= 2  # several guesses for the first token
    for _ in range(60):  # now the first guesses are always accepted: a chain does as well, for less
        d = decide(p, req)
        if d.template is None:
            p.record("r", d, 4, 4)
        else:
            p.record("r", d, len(d.template), 4, outcomes=[(1, 0)] * 4)
        p.end_step()
    d = decide(p, req)
    assert d.num_draft_slots == 4 and d.template is None


def test_without_adaptive_every_round_uses_the_configured_tree():
    d = decide(policy(adaptive=False), request())
    assert d.num_draft_slots == 12 and len(d.template) == 12
    static = SpeculativeConfig(method="early_exit", adaptive=False, speculative_token_tree=[[0], [1], [0, 0]])
    d = decide(SpecPolicy(static, 0.1, StepCosts.linear(0.05)), request())
    assert d.num_draft_slots == 3 and d.template == (-1, -1, 0)


def test_a_request_under_a_grammar_gets_chains():
    d = decide(policy(adaptive=False), Request("r", 0, trees=False))
    assert d.num_draft_slots == 4 and d.template is None


@pytest.mark.parametrize("bad", [
    dict(tree_width=0), dict(max_tree_nodes=0), dict(speculative_token_tree="[(1,)]"),
    dict(speculative_token_tree="not a tree"), dict(speculative_token_tree=[]),
    dict(method="ngram", speculative_token_tree=[[0]]),
])
def test_bad_tree_config_is_refused(bad):
    with pytest.raises(ValueError):
        SpeculativeConfig(**{"method": "early_exit", **bad})
