"""Tree data and tree verification on small hand-drawn trees, and the chain case
against the chain sampler with the same random numbers."""

import pytest
import torch

from engine.utils import tree
from engine.spec_decode.drafter import Draft
from engine.spec_decode.metadata import build_verify_metadata
from engine.spec_decode.rejection_sampler import PLACEHOLDER, rejection_sample
from engine.spec_decode.tree_sampler import tree_verify
from engine.spec_decode.verify import greedy_rule

# The reference's example:      root
#                              /    \
#                             0      1
#                            / \     |
#                           2   3    4
#                           |
#                           5
PARENTS = (-1, -1, 0, 0, 1, 2)


def test_tree_indices_of_the_reference_example():
    assert tree.depths(PARENTS).tolist() == [0, 0, 1, 1, 1, 2]
    assert tree.ranks(PARENTS).tolist() == [0, 1, 0, 1, 0, 0]
    assert tree.children_table(PARENTS, 2).tolist() == [[0, 1], [2, 3], [4, -1], [5, -1], [-1, -1], [-1, -1], [-1, -1]]
    assert tree.path(PARENTS, 5) == [0, 2, 5]
    assert tree.path_tokens([10, 11, 12, 13, 14, 15], PARENTS, 6)[6] == [10, 12, 15]
    assert tree.is_chain((-1, 0, 1)) and not tree.is_chain(PARENTS)
    meta = build_verify_metadata([[0] * 6], [PARENTS], [None], 10)
    assert meta.children.tolist() == tree.children_table(PARENTS, 2).tolist()  # one request: its own table
    with pytest.raises(ValueError):
        tree.depths((0,))


def test_merge_paths_shares_prefixes_and_respects_the_budget():
    assert tree.merge_paths([[5, 6, 7], [5, 8], [9]], 10) == ([5, 6, 7, 8, 9], (-1, 0, 1, 0, -1))
    assert tree.merge_paths([[5, 6, 7], [5, 8], [9]], 3) == ([5, 6, 7], (-1, 0, 1))


def test_static_tree_literal_as_vllm_writes_it():
    assert tree.parse_static_tree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]) == PARENTS
    for bad in ([(1,)], [(0, 0)], [(0,), (0,)], [()]):
        with pytest.raises(ValueError):
            tree.parse_static_tree(bad)


def greedy_walk(argmax_rows: list[int], tokens: list[int]):
    verified = greedy_rule(argmax_rows, [Draft(tokens, None, PARENTS)])
    return verified.tokens[0], len(verified.paths[0]), verified.paths[0]


def test_greedy_walk_follows_the_matching_child_then_takes_the_target_token():
    tokens = [7, 8, 9, 3, 4, 5]  # node i's token
    # row 0 (root) wants 8 -> node 1; row 2 (node 1) wants 4 -> node 4 (a leaf); bonus = row 5's argmax
    out, acc, nodes = greedy_walk([8, 0, 4, 0, 0, 6, 0], tokens)
    assert (out, acc, nodes) == ([8, 4, 6], 2, [1, 4])
    # root wants 7 -> node 0; node 0 wants 3 -> node 3 (second sibling); its row wants 2: recovered
    out, acc, nodes = greedy_walk([7, 3, 0, 0, 2, 0, 0], tokens)
    assert (out, acc, nodes) == ([7, 3, 2], 2, [0, 3])
    # the deepest branch: 7, 9, 5, then the bonus after node 5
    out, acc, _ = greedy_walk([7, 9, 0, 5, 0, 0, 1], tokens)
    assert (out, acc) == ([7, 9, 5, 1], 3)
    # nothing matches at the root
    assert greedy_walk([1, 0, 0, 0, 0, 0, 0], tokens)[:2] == ([1], 0)


def test_deterministic_siblings_second_child_accepted_against_the_updated_residual():
    # p at the root = (0.5, 0.3, 0.2); children 0 then 1 (one-hot q). Child 0 is rejected when
    # u >= 0.5; then R = (0, 0.6, 0.4), so child 1 is accepted when u < 0.6 -- not 0.3.
    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0, 0], [0, 0, 1.0]])
    meta = build_verify_metadata([[0, 1]], [(-1, -1)], [None], 3)

    def run(u0, u1, noise=(1.0, 1.0, 1.0)):
        out, acc, _ = tree_verify(meta, p, torch.tensor([u0, u1]), torch.tensor([noise]))
        return out[0].tolist()[: int(acc[0]) + 1], int(acc[0])  # rows padded to the deepest tree's levels

    assert run(0.4, 0.99) == ([0, 0], 1)  # child 0 accepted, bonus from its row (all on token 0)
    assert run(0.6, 0.5) == ([1, 2], 1)  # child 0 rejected, child 1 accepted (0.5 < 0.6), bonus token 2
    assert run(0.6, 0.7) == ([2], 0)  # both rejected: the residual is all on token 2


@pytest.mark.parametrize("seed", range(5))
def test_a_chain_gives_exactly_the_chain_samplers_output(seed):
    g = torch.Generator().manual_seed(seed)
    n, k, v = 64, 4, 7
    num = torch.randint(0, k + 1, (n,), generator=g).tolist()
    probs = torch.rand(sum(num) + n, v, generator=g) ** 3
    probs /= probs.sum(-1, keepdim=True)
    q = [torch.rand(m, v, generator=g) ** 3 for m in num]
    q = [x / x.sum(-1, keepdim=True) for x in q]
    ids = [torch.multinomial(x, 1, generator=g).view(-1).tolist() if len(x) else [] for x in q]
    uniforms = torch.rand(sum(num), generator=g)
    noise = torch.empty(n, v).exponential_(generator=g)
    for q_used in (q, [None] * n):
        chains = build_verify_metadata(ids, [None] * n, q_used, v)
        as_trees = build_verify_metadata(ids, [tree.chain(m) for m in num], q_used, v, with_children=True)
        want, want_acc = rejection_sample(probs, chains, uniforms, noise)
        got, got_acc, _ = tree_verify(as_trees, probs, uniforms, noise)
        assert torch.equal(got_acc, want_acc)
        assert torch.equal(got, want[:, : got.shape[1]])
        assert (want[:, got.shape[1]:] == PLACEHOLDER).all()

