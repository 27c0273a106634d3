"""Tree shapes in the speculation policy: the expected accepted length of a
hand-drawn tree, the choice between trees and chains driven by the recorded
per-depth, per-rank acceptance, and the configuration keys."""

import pytest

from engine.config import SpeculativeConfig
from engine.spec_decode.fixed_policy import FixedPolicy
from engine.spec_decode.policy import Candidate as Request, SpecPolicy, StepCosts
from engine.utils import tree
from engine.spec_decode.tree_policy import PRIOR_SIBLING, Candidate, best_grown, expected_accepted, grown, update


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
    # rank 1 starts from the prior at both depths: accepted at depth 0, rejected at depth 1
    assert rank0 == [0.25, 0.25] and siblings == [[PRIOR_SIBLING + 0.5 * (1 - PRIOR_SIBLING)], [0.5 * PRIOR_SIBLING]]


def _closed_subtrees(full: tuple[int, ...], size: int):
    """Every set of ``size`` nodes of ``full`` that holds each node's parent and elder
    siblings, as a parent list (in ``full``'s order)."""
    ranks = tree.ranks(full)
    elder = {i: next(j for j in range(i - 1, -1, -1) if full[j] == full[i]) for i in range(len(full)) if ranks[i]}
    for mask in range(1 << len(full)):
        keep = [i for i in range(len(full)) if mask >> i & 1]
        if len(keep) != size:
            continue
        kept = set(keep)
        if all((full[i] < 0 or full[i] in kept) and (i not in elder or elder[i] in kept) for i in keep):
            new = {old: n for n, old in enumerate(keep)}
            yield tuple(new[full[i]] if full[i] >= 0 else -1 for i in keep)


@pytest.mark.parametrize("rank0, siblings", [
    ([0.7, 0.5, 0.3], [[0.4], [0.2], [0.1]]),
    ([0.3, 0.9, 0.9], [[0.6], [0.05], [0.5]]),
    ([0.5, 0.5, 0.5], []),  # siblings from the prior
])
def test_grown_trees_are_the_best_trees_of_their_size(rank0, siblings):
    """Against brute force over every tree of width 2 and depth 3 (sibling rates below the
    elder's, so no node is worth more than one taken before it)."""
    template, values = grown(rank0, siblings, max_depth=3, width=2, max_nodes=6)
    full = tree.product_tree([2, 2, 2], 14)
    for n in range(1, 7):
        best = max(expected_accepted(Candidate.of(t), rank0, siblings) for t in _closed_subtrees(full, n))
        assert sum(values[:n]) == pytest.approx(best)
        assert expected_accepted(Candidate.of(template[:n]), rank0, siblings) == pytest.approx(best)


def test_a_grown_tree_holds_the_best_chain_and_adds_only_siblings_that_pay():
    rank0 = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4]
    # near-free nodes: the whole budget is worth spending
    free = [1.0 + 0.001 * n for n in range(9)]
    template, _ = best_grown(rank0, [[0.0] * 2] * 6, 6, 3, free, 0.0)
    assert template == tree.chain(6)  # worthless siblings: the chain, to the depth limit
    template, _ = best_grown(rank0, [[0.5, 0.3]] + [[0.0] * 2] * 5, 6, 3, free, 0.0)
    # the chain, then the second guess for the first token (0.1 * 0.5) and its own continuation
    # (0.05 * 0.8), worth more than a third guess (0.1 * 0.5 * 0.3)
    assert template == tree.chain(6) + (-1, 6)
    # costly nodes: stop where one more node costs more than it brings
    template, gain = best_grown(rank0, [[0.0] * 2] * 6, 6, 3, [1.0 + 0.8 * n for n in range(9)], 0.0)
    assert template == tree.chain(1) and gain == pytest.approx(1.9 / 1.8)  # two: 2.62 / 2.6
    # drafting passes cost per depth, not per node: a wide tree of depth 1 beats a chain and the
    # deeper tree that the best-first order reaches first (the child, 0.16, before rank 2, 0.126)
    template, gain = best_grown([0.4, 0.4], [[0.3, 0.3]], 2, 3, free, 0.5)
    assert template == (-1, -1, -1) and gain == pytest.approx((1 + 0.4 + 0.18 + 0.126) / (1.003 + 0.5))


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
    assert d.num_draft_tokens == 4 and d.template is None


def fixed(**kw) -> FixedPolicy:
    return FixedPolicy(SpeculativeConfig(method="ngram", num_speculative_tokens=4, tree_width=3, max_tree_nodes=12,
                                         adaptive=False, **kw))


def test_the_fixed_policy_uses_the_configured_tree_every_round():
    d = decide(fixed(), request())
    assert d.num_draft_tokens == 12 and len(d.template) == 12
    static = SpeculativeConfig(method="early_exit", adaptive=False, speculative_token_tree=[[0], [1], [0, 0]])
    d = decide(FixedPolicy(static), request())
    assert d.num_draft_tokens == 3 and d.template == (-1, -1, 0)


def test_a_request_under_a_grammar_gets_chains():
    d = decide(fixed(), Request("r", 0, trees=False))
    assert d.num_draft_tokens == 4 and d.template is None


@pytest.mark.parametrize("bad", [
    dict(tree_width=0), dict(max_tree_nodes=0), dict(speculative_token_tree="[(1,)]"),
    dict(speculative_token_tree="not a tree"), dict(speculative_token_tree=[]),
    dict(method="ngram", speculative_token_tree=[[0]]),
])
def test_bad_tree_config_is_refused(bad):
    with pytest.raises(ValueError):
        SpeculativeConfig(**{"method": "early_exit", **bad})


def test_a_static_tree_deeper_than_num_speculative_tokens_is_refused():
    """A round accepts at most num_speculative_tokens drafts; a deeper tree could accept more."""
    deep = [[0], [0, 0], [0, 0, 0]]
    with pytest.raises(ValueError, match="3 nodes deep, more than num_speculative_tokens=2"):
        SpeculativeConfig(method="early_exit", num_speculative_tokens=2, speculative_token_tree=deep)
    config = SpeculativeConfig(method="early_exit", num_speculative_tokens=3, speculative_token_tree=deep)
    assert config.static_tree() == (-1, 0, 1)
