"""Verification of sampled requests' token trees: recursive rejection.

Extends ``engine.spec_decode.rejection_sampler`` (a chain is the tree of width 1 and gives
the same outputs from the same random numbers) to trees (``engine.utils.tree``),
vectorized over the batch with one loop over depth and one over sibling rank.
Request ``r`` drafted ``num_nodes[r]`` nodes; row 0 of its target distributions
is ``p`` after the last committed token, row ``i + 1`` is ``p`` after node ``i``
(conditioned on node ``i``'s branch only: the tree attention mask).

Rule, starting at the root with ``R = p_root`` (the reference's section "Token
trees check several guesses at once", *recursive rejection at a node with
several children*; SpecInfer's multi-step speculative sampling):

* try the current node's children ``s_1, s_2, ...`` in order; child ``s_i``
  drafted from ``q_i`` is accepted iff ``u < R(s_i) / q_i(s_i)`` (``u`` the
  child's own uniform);
* after a rejection, ``R <- normalize(max(0, R - q_i))`` before the next sibling;
* on acceptance move to the child, with ``R = p_child``, and repeat;
* when no child is accepted, emit the *recovered* token, sampled from ``R``;
  at a leaf, the *bonus* token from ``R = p_leaf``.

Exactness (proof sketch). At one node with target ``R_1 = p``, backward
induction on the try index ``i``: if the continuation after a rejected try ``i``
outputs ``R_{i+1}`` whatever was drawn before, then try ``i`` outputs
``min(q_i, R_i) + (1 - sum min(q_i, R_i)) * R_{i+1} = R_i`` -- the one-draft
rule with target ``R_i``. The induction needs only that ``s_i ~ q_i`` given
everything drawn before it (earlier siblings and their subtrees), so ``q_i``
may depend on the earlier siblings:

* i.i.d. children: ``q_i = q`` (the reference's theorem);
* children without replacement (Sequoia): ``q_i = q`` with the earlier siblings
  zeroed and renormalized, the ``q`` a sampling drafter must send per node;
* deterministic drafter (prompt lookup, top-W by the draft's own scores),
  siblings distinct: ``q_i`` is one-hot at ``s_i``, so ``s_i`` is accepted with
  probability ``R_i(s_i)`` and a rejection zeroes ``s_i`` in ``R`` and
  renormalizes. Some child is accepted with probability ``sum_i p(s_i)``. The
  tree is a function of the context alone, so conditioning on it changes nothing.

The number and order of children may depend on what was drafted before them,
never on a child's own token beyond its draw (non-anticipation). After an
acceptance, the subtree is drafted from ``q`` conditioned on the branch, so the
same argument applies level by level and the emitted sequence is distributed
exactly as the target's.

Inputs are flat (``engine.spec_decode.metadata``): rows and drafts request after
request, ``meta.children`` the tree of every row. Output ``[n, L + 1]`` (``L`` the
longest accepted path in the batch): the accepted path's tokens, the recovered or
bonus token, ``PLACEHOLDER`` padding; ``num_accepted [n]``; ``accepted_nodes
[n, L]`` (node index within its request per accepted depth, ``PLACEHOLDER`` past).
"""

import torch

from engine.spec_decode.rejection_sampler import PLACEHOLDER, residual_distribution
from engine.spec_decode.metadata import VerifyMetadata


def tree_verify(
    meta: VerifyMetadata,  # meta.children [R, W] must be set
    target_probs: torch.Tensor,  # [R, V]
    uniforms: torch.Tensor,  # [D] U[0, 1), one per node
    noise: torch.Tensor,  # [n, V] Exp(1) for the recovered / bonus token
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(output_ids [n, L + 1], num_accepted [n], accepted_nodes [n, L])``, L the
    deepest tree's levels (``meta.max_depth``), rows padded with PLACEHOLDER."""
    children, ids, q_all = meta.children, meta.draft_token_ids, meta.draft_probs
    width = children.shape[1]
    n = meta.num_requests
    b = torch.arange(n, device=ids.device)
    draft_rows = meta.draft_rows()  # [D]: row r + 1 + d of draft d of request r
    cur = meta.first_rows.clone()  # [n] current row
    done = torch.zeros(n, dtype=torch.bool, device=cur.device)
    path: list[torch.Tensor] = []  # accepted draft (flat index) per depth, -1 where none
    r = target_probs[cur]  # [n, V] the target the next child is tried against
    for _ in range(meta.max_depth + 1):  # one level a pass; bounds known on the host: no device sync
        moved = torch.zeros_like(done)
        for j in range(width):
            child = children[cur, j]  # [n] flat draft index
            trying = ~done & ~moved & (child >= 0)
            c = child.clamp(min=0)
            x = ids[c]  # [n]
            q = _node_q(q_all, c, x, r)  # [n, V]
            accept = uniforms[c] * q[b, x] < r[b, x]  # u < R/q without dividing by a zero q
            rejected = (trying & ~accept).unsqueeze(1)
            r = torch.where(rejected, residual_distribution(r, q), r)  # the next sibling's target
            accept &= trying
            cur = torch.where(accept, draft_rows[c], cur)
            moved |= accept
        path.append(torch.where(moved, cur - b - 1, PLACEHOLDER))  # the draft at row cur: cur - r - 1
        r = torch.where(moved.unsqueeze(1), target_probs[cur], r)
        done |= ~moved
    accepted = torch.stack(path[:-1], dim=1) if len(path) > 1 else cur.new_zeros(n, 0)  # [n, L] flat
    num_accepted = (accepted >= 0).sum(dim=1)
    # R: the recovered token's distribution, or at a leaf p_leaf itself (the bonus, drawn as the chain rule does)
    extra = (r / noise).argmax(dim=1)  # exponential race
    start = meta.draft_starts.unsqueeze(1)  # [n, 1]
    nodes = torch.where(accepted >= 0, accepted - start, PLACEHOLDER)  # within each request
    return _assemble(ids, accepted, num_accepted, extra), num_accepted, nodes


def _node_q(draft_probs: torch.Tensor | None, c: torch.Tensor, x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """q of each request's tried child: its own row, or one-hot at its token. [n, V]."""
    if draft_probs is not None:
        return draft_probs[c]
    q = torch.zeros_like(like)
    q.scatter_(1, x.unsqueeze(1), 1.0)
    return q


def _assemble(ids, accepted, num_accepted, extra) -> torch.Tensor:
    """[n, L + 1]: the accepted path's tokens, the extra token, PLACEHOLDER padding."""
    n, depth = accepted.shape
    out = torch.full((n, depth + 1), PLACEHOLDER, dtype=torch.long, device=ids.device)
    if depth:
        out[:, :depth] = torch.where(accepted >= 0, ids[accepted.clamp(min=0)], PLACEHOLDER)
    out.scatter_(1, num_accepted.unsqueeze(1), extra.unsqueeze(1))
    return out
