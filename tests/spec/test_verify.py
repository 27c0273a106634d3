"""The verification function on hand-made inputs: the reference's worked
example computed exactly, greedy matching, bonus tokens, padding."""

import numpy as np
import torch

from engine.utils import tree
from engine.spec_decode.drafter import Draft
from engine.spec_decode.metadata import build_verify_metadata
from engine.spec_decode.rejection_sampler import PLACEHOLDER, rejection_sample, residual_distribution
from engine.spec_decode.tree_sampler import tree_verify
from engine.spec_decode.verify import greedy_rule, verify

P = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
Q = torch.tensor([0.2, 0.6, 0.2], dtype=torch.float64)


def chains(drafts, probs=None, vocab=3):
    """Flat metadata of one chain of drafts per request; ``probs`` per request or None."""
    return build_verify_metadata(drafts, [None] * len(drafts), probs or [None] * len(drafts), vocab)


def verify_one(p_rows, q_rows, drafts, u, noise=None):
    p = torch.stack(p_rows).float()  # [k + 1, V]
    q = torch.stack(q_rows).float() if q_rows is not None else None
    meta = chains([drafts], [q], vocab=p.shape[1])
    noise = torch.ones(1, p.shape[1]) if noise is None else noise
    out, acc = rejection_sample(p, meta, torch.tensor(u).float(), noise)
    return out[0].tolist(), int(acc[0])


def acceptance_probability(x: int, grid: int = 10_000) -> float:
    """P(accept draft x): the fraction of a fine, exact grid of uniforms u that accepts."""
    us = (np.arange(grid) + 0.5) / grid
    accepted = sum(verify_one([P, P], [Q], [x], [u])[1] for u in us[:: grid // 1000])
    return accepted / 1000


def test_worked_example_accepts_with_probability_0_7_and_emits_exactly_p():
    # Acceptance per drafted token, read off the real function over a grid of u.
    accept = {x: acceptance_probability(x) for x in range(3)}
    assert accept == {0: 1.0, 1: 0.5, 2: 1.0}
    assert abs(sum(Q[x].item() * accept[x] for x in range(3)) - 0.7) < 1e-12
    residual = residual_distribution(P.unsqueeze(0), Q.unsqueeze(0))[0]
    assert torch.allclose(residual, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    # Enumerate: draft x ~ q; kept with prob accept[x]; else replaced by a residual sample.
    emitted = torch.zeros(3, dtype=torch.float64)
    for x in range(3):
        emitted[x] += Q[x] * accept[x]
        emitted += Q[x] * (1 - accept[x]) * residual
    assert torch.allclose(emitted, P, atol=1e-12)


def test_rejection_returns_the_residual_sample_and_padding():
    # Draft b is rejected when u >= p(b)/q(b) = 0.5; the residual is all on a.
    out, acc = verify_one([P, P, P], [Q, Q], [1, 1], [0.9, 0.0])
    assert (out, acc) == ([0, PLACEHOLDER, PLACEHOLDER], 0)
    out, acc = verify_one([P, P, P], [Q, Q], [1, 1], [0.1, 0.9])
    assert (out, acc) == ([1, 0, PLACEHOLDER], 1)


def test_all_accepted_gives_a_bonus_token_from_p():
    noise = torch.tensor([[1.0, 1.0, 0.01]])  # the exponential race then picks token 2
    out, acc = verify_one([P, P, P], [Q, Q], [0, 2], [0.0, 0.0], noise=noise)
    assert (out, acc) == ([0, 2, 2], 2)


def test_deterministic_drafts_use_a_one_hot_q():
    # q one-hot at x: accept with probability p(x); residual = p without x.
    out, acc = verify_one([P, P], None, [0], [0.49])
    assert acc == 1
    out, acc = verify_one([P, P], None, [0], [0.51], noise=torch.tensor([[0.01, 1.0, 1.0]]))
    assert acc == 0 and out[0] != 0  # the drafted token itself has no residual mass


def test_greedy_keeps_the_longest_matching_prefix_then_the_target_token():
    argmax = [3, 1, 4, 2]  # the target's choice after 0, 1, 2, 3 drafts
    verified = greedy_rule(argmax, [Draft([3, 1, 0])])
    assert (verified.tokens, verified.paths) == ([[3, 1, 4]], [[0, 1]])
    verified = greedy_rule(argmax, [Draft([3, 1, 4])])
    assert (verified.tokens, verified.paths) == ([[3, 1, 4, 2]], [[0, 1, 2]])
    assert greedy_rule([7], [None]).tokens == [[7]]  # no drafts: the row's own argmax


def test_batch_rows_are_independent_and_padded():
    p = torch.stack([P] * 5).float()  # 3 rows for the first request, 2 for the second: nothing padded
    meta = chains([[1, 1], [0]])
    assert meta.cu_num_draft_tokens.tolist() == [2, 3] and meta.target_logits_indices.tolist() == [0, 1, 3]
    out, acc = rejection_sample(p, meta, torch.full((3,), 0.1), torch.ones(2, 3))
    assert acc.tolist() == [2, 1]
    assert out[1, 2].item() == PLACEHOLDER


def test_flat_layout_of_the_metadata_docstring():
    meta = build_verify_metadata([[5, 6], [], [7, 8, 9]], [None, None, (-1, -1, 0)], [None] * 3, 10)
    assert meta.cu_num_draft_tokens.tolist() == [2, 2, 5] and meta.first_rows.tolist() == [0, 3, 4]
    assert meta.target_logits_indices.tolist() == [0, 1, 4, 4, 5]
    assert meta.draft_rows().tolist() == [1, 2, 5, 6, 7]
    assert meta.children[4].tolist() == [2, 3] and meta.children[5].tolist() == [4, -1]
    assert meta.request_index.tolist() == [0, 0, 2, 2, 2] and meta.max_num_draft_tokens == 3


def one_hot_rows(argmax: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, V]: p one-hot at each row's argmax, the distribution a greedy request samples from."""
    return torch.nn.functional.one_hot(argmax, vocab).float()


def test_the_greedy_rule_is_the_rejection_rule_at_a_one_hot_p():
    """On chains of random lengths (none included), the greedy rule gives the tokens and
    accepted counts the rejection rule gives with p one-hot at the argmax, whatever the
    uniforms and noise."""
    gen = torch.Generator().manual_seed(0)
    n, k, vocab = 64, 5, 4  # a small vocabulary so that many drafts match
    lengths = torch.randint(0, k + 1, (n,), generator=gen).tolist()
    drafted = [torch.randint(0, vocab, (m,), generator=gen).tolist() for m in lengths]
    argmax = torch.randn(sum(map(len, drafted)) + n, vocab, generator=gen).argmax(-1)
    out, acc = rejection_sample(one_hot_rows(argmax, vocab), chains(drafted, vocab=vocab),
                                torch.rand(sum(map(len, drafted)), generator=gen), torch.rand(n, vocab, generator=gen) + 0.1)
    verified = greedy_rule(argmax.tolist(), [Draft(d) if d else None for d in drafted])
    for i, d in enumerate(drafted):
        j = int(acc[i])
        assert verified.tokens[i] == out[i, : j + 1].tolist() and verified.paths[i] == list(range(j))
    assert 0 < acc.float().mean() < k  # the case mix covers rejections and full acceptance


def test_a_batch_mixing_drafts_with_and_without_probs_gives_each_its_own_q():
    q_model = torch.tensor([[0.2, 0.6, 0.2], [0.1, 0.1, 0.8]])
    q = chains([[1, 2], [0], []], [q_model, None, None]).draft_probs  # [3 drafts, V]
    assert torch.equal(q[:2], q_model)
    assert q[2].tolist() == [1.0, 0.0, 0.0]  # one-hot at the drafted token
    assert chains([[0], []]).draft_probs is None  # all deterministic: the sampler's own one-hot


def test_a_deterministic_draft_is_verified_alike_beside_a_sampled_one():
    """The deterministic row of a mixed batch accepts and recovers exactly as in a batch of its own."""
    p = torch.stack([P] * 4).float()  # [4 rows, 3]
    mixed = chains([[1], [0]], [Q.unsqueeze(0).float(), None])
    noise = torch.tensor([[1.0, 1.0, 1.0], [0.01, 1.0, 0.5]])
    accepted = 0
    for u in (np.arange(100) + 0.5) / 100:
        out, acc = rejection_sample(p, mixed, torch.tensor([u, u]).float(), noise)
        alone, alone_acc = verify_one([P, P], None, [0], [u], noise=noise[1:])
        assert (out[1].tolist(), int(acc[1])) == (alone, alone_acc)
        accepted += int(acc[1])
    assert accepted == 50  # p(0) = 0.5 of the uniforms accept it, not every one (q = 0 would accept all)


def random_tree(gen, nodes: int, vocab: int) -> tuple[list[int], tuple[int, ...]]:
    """Tokens and parents of a random tree, siblings distinct, parents first."""
    parents, tokens = [], []
    for i in range(nodes):
        parent = int(torch.randint(-1, i, (1,), generator=gen)) if i else -1
        taken = {t for t, p in zip(tokens, parents) if p == parent}
        free = [t for t in range(vocab) if t not in taken]
        if not free:
            break
        parents.append(parent)
        tokens.append(free[int(torch.randint(0, len(free), (1,), generator=gen))])
    return tokens, tuple(parents)


def test_the_greedy_rule_on_trees_is_tree_verify_at_a_one_hot_p():
    """On random trees (and chains and no drafts beside them in one batch) the greedy rule
    returns the tokens and accepted nodes of ``tree_verify`` with p one-hot at the argmax."""
    gen = torch.Generator().manual_seed(2)
    n, vocab = 96, 3
    drafts = []
    for i in range(n):
        size = int(torch.randint(0, 8, (1,), generator=gen))
        tokens, parents = random_tree(gen, size, vocab)
        drafts.append(None if not tokens else Draft(tokens, None, None if tree.is_chain(parents) else parents))
    num_drafts = sum(len(d.token_ids) for d in drafts if d)
    argmax = torch.randn(num_drafts + n, vocab, generator=gen).argmax(-1)
    meta = build_verify_metadata([d.token_ids if d else [] for d in drafts], [d.parents if d else None for d in drafts],
                                 [None] * n, vocab)
    out, acc, nodes = tree_verify(meta, one_hot_rows(argmax, vocab), torch.rand(num_drafts, generator=gen),
                                  torch.rand(n, vocab, generator=gen) + 0.1)
    verified = greedy_rule(argmax.tolist(), drafts)
    deep = 0
    for i, d in enumerate(drafts):
        j = int(acc[i])
        path = [x for x in nodes[i].tolist() if x >= 0]
        assert verified.tokens[i] == out[i, : j + 1].tolist() and verified.paths[i] == path
        deep += j >= 2 and d is not None and d.parents is not None and path[-1] != j - 1
    assert deep > 0  # some accepted paths leave the first-child chain


def test_a_mixed_batch_sends_each_request_to_its_own_rule():
    """Greedy requests beside sampled ones get the greedy rule's tokens; the sampled ones get
    what the rejection rule gives them in a batch of their own, with the same random numbers."""
    gen = torch.Generator().manual_seed(3)
    vocab = 5
    drafts = [Draft([1, 2]), None, Draft([3, 0, 4], None, (-1, -1, 0)), Draft([2])]
    greedy = [True, False, False, True]
    rows = sum(len(d.token_ids) for d in drafts if d) + len(drafts)  # 10
    probs = torch.rand(rows, vocab, generator=gen).softmax(-1)
    argmax = probs.argmax(-1).tolist()
    uniforms, noise = torch.rand(3, generator=gen), torch.rand(2, vocab, generator=gen) + 0.1
    mixed = verify(drafts, greedy, probs.argmax(-1), probs, uniforms, noise)
    sampled_rows = torch.tensor([3, 4, 5, 6, 7])  # request 1's row, then request 2's four
    alone = verify([drafts[1], drafts[2]], [False, False], None, probs[sampled_rows], uniforms, noise)
    assert [mixed.tokens[1], mixed.tokens[2]] == alone.tokens and [mixed.paths[1], mixed.paths[2]] == alone.paths
    greedy_alone = greedy_rule(argmax[:3] + argmax[8:], [drafts[0], drafts[3]])
    assert [mixed.tokens[0], mixed.tokens[3]] == greedy_alone.tokens
