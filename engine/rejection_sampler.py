"""Verification of drafted tokens: greedy matching and the rejection rule.

One pure, vectorized function over the batch. Request ``r`` drafted
``num_drafts[r] <= K`` tokens ``x_1 .. x_k``; the target pass gave the processed
distributions ``p_1 .. p_{k+1}`` (``p_i`` conditioned on the drafts before ``x_i``).

Rule, per position ``i = 1 .. k`` from left to right, stopping at the first
rejection (Leviathan et al. 2023, Alg. 1):

* greedy request: accept ``x_i`` iff it equals ``argmax p_i``;
* sampled request: accept ``x_i`` iff ``u_i < p_i(x_i) / q_i(x_i)``, ``u_i ~ U[0, 1)``,
  where ``q_i`` is the distribution the drafter really sampled ``x_i`` from
  (one-hot for a deterministic drafter such as prompt lookup).

With ``J`` drafts accepted (the *accepted* tokens), one more token is emitted:

* ``J < k``: the *recovered* token, sampled from ``normalize(max(0, p_{J+1} - q_{J+1}))``
  (greedy: ``argmax p_{J+1}``);
* ``J = k``: the *bonus* token, sampled from ``p_{k+1}`` (greedy: its argmax).

Appending a zero row to ``q`` makes the bonus case the residual formula at
``J = k``. The output is ``[n, K + 1]``: accepted drafts, then the recovered or
bonus token, then ``PLACEHOLDER`` padding.
"""

import torch

PLACEHOLDER = -1


def rejection_sample(
    target_probs: torch.Tensor,  # [n, K + 1, V] processed p; unused rows arbitrary
    target_argmax: torch.Tensor,  # [n, K + 1] greedy choice of the target per row
    draft_ids: torch.Tensor,  # [n, K] long, PLACEHOLDER past num_drafts
    draft_probs: torch.Tensor | None,  # [n, K, V] q; None: every draft is deterministic (one-hot q)
    num_drafts: torch.Tensor,  # [n] long
    greedy: torch.Tensor,  # [n] bool
    uniforms: torch.Tensor,  # [n, K] U[0, 1)
    noise: torch.Tensor,  # [n, V] Exp(1), for the recovered / bonus token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(output_ids [n, K + 1], num_accepted [n])``."""
    n, k_max = draft_ids.shape
    pos = torch.arange(k_max, device=draft_ids.device).unsqueeze(0)  # [1, K]
    drafted = pos < num_drafts.unsqueeze(1)  # [n, K]
    safe_ids = draft_ids.clamp(min=0)
    p_x = target_probs[:, :k_max].gather(2, safe_ids.unsqueeze(2)).squeeze(2)  # [n, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(2, safe_ids.unsqueeze(2)).squeeze(2)
    accept_random = uniforms * q_x < p_x  # u < p/q without dividing by a zero q
    accept_greedy = draft_ids == target_argmax[:, :k_max]
    accept = torch.where(greedy.unsqueeze(1), accept_greedy, accept_random) & drafted
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)  # [n]

    # The distribution of the extra token at row J: residual, or p itself at J = k.
    rows = num_accepted.view(n, 1, 1).expand(n, 1, target_probs.shape[2])
    p_j = target_probs.gather(1, rows).squeeze(1)  # [n, V]
    q_j = _draft_row(draft_probs, draft_ids, num_accepted, num_drafts, p_j)
    recovered = (residual_distribution(p_j, q_j) / noise).argmax(dim=1)  # exponential race
    extra = torch.where(greedy, target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1), recovered)

    return _assemble(draft_ids, num_accepted, extra), num_accepted


def greedy_verify(
    target_argmax: torch.Tensor,  # [n, K + 1]
    draft_ids: torch.Tensor,  # [n, K] long, PLACEHOLDER past num_drafts
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule when every request is greedy: keep the longest prefix of drafts
    equal to the target's argmaxes, then the target's argmax after it.
    Same outputs as ``rejection_sample`` with all ``greedy`` set, without
    distributions or randomness. Returns ``(output_ids [n, K + 1], num_accepted [n])``."""
    accept = draft_ids == target_argmax[:, : draft_ids.shape[1]]  # PLACEHOLDER never matches
    num_accepted = accept.int().cumprod(dim=1).sum(dim=1)  # [n]
    extra = target_argmax.gather(1, num_accepted.unsqueeze(1)).squeeze(1)
    return _assemble(draft_ids, num_accepted, extra), num_accepted


def _assemble(draft_ids: torch.Tensor, num_accepted: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """[n, K + 1]: the accepted drafts, the extra token, PLACEHOLDER padding."""
    n, k_max = draft_ids.shape
    pos = torch.arange(k_max, device=draft_ids.device).unsqueeze(0)  # [1, K]
    out = torch.full((n, k_max + 1), PLACEHOLDER, dtype=torch.long, device=draft_ids.device)
    out[:, :k_max] = torch.where(pos < num_accepted.unsqueeze(1), draft_ids, PLACEHOLDER)
    out.scatter_(1, num_accepted.unsqueeze(1), extra.unsqueeze(1))
    return out


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalize(max(0, p - q))`` per row; ``p`` where p <= q everywhere (then a
    rejection cannot happen, so any choice is exact). [n, V] -> [n, V]."""
    residual = (p - q).clamp(min=0)
    mass = residual.sum(dim=1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)


def _draft_row(draft_probs, draft_ids, num_accepted, num_drafts, like: torch.Tensor) -> torch.Tensor:
    """q at row J (the first rejected draft); zeros when J = k (bonus). [n, V]."""
    n, k_max = draft_ids.shape
    rejected = num_accepted < num_drafts  # [n]
    j = num_accepted.clamp(max=max(k_max - 1, 0))
    if k_max == 0:
        return torch.zeros_like(like)
    if draft_probs is None:
        q = torch.zeros_like(like)
        ids = draft_ids.gather(1, j.unsqueeze(1)).clamp(min=0)  # [n, 1]
        q.scatter_(1, ids, 1.0)
    else:
        q = draft_probs.gather(1, j.view(n, 1, 1).expand(n, 1, like.shape[1])).squeeze(1)
    return q * rejected.unsqueeze(1)
