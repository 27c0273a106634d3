"""Verification of sampled requests' draft chains: the rejection rule.

One pure, vectorized function over the batch (greedy requests take
``engine.spec_decode.verify.greedy_rule``). Request ``r`` drafted
``num_drafts[r] <= K`` tokens ``x_1 .. x_k``; the target pass gave the processed
distributions ``p_1 .. p_{k+1}`` (``p_i`` conditioned on the drafts before ``x_i``).

Rule, per position ``i = 1 .. k`` from left to right, stopping at the first
rejection (Leviathan et al. 2023, Alg. 1):

accept ``x_i`` iff ``u_i < p_i(x_i) / q_i(x_i)``, ``u_i ~ U[0, 1)``, where ``q_i``
is the distribution the drafter really sampled ``x_i`` from (one-hot for a
deterministic drafter such as prompt lookup).

With ``J`` drafts accepted (the *accepted* tokens), one more token is emitted:

* ``J < k``: the *recovered* token, sampled from ``normalize(max(0, p_{J+1} - q_{J+1}))``;
* ``J = k``: the *bonus* token, sampled from ``p_{k+1}``.

Taking ``q_{k+1} = 0`` makes the bonus case the residual formula at ``J = k``; it is
drawn from ``p_{k+1}`` itself, as plain sampling draws a row (the residual would
divide by a sum that is 1 only up to rounding).

Inputs are flat (``engine.spec_decode.metadata``): ``R = D + n`` rows of
distributions, request after request, and the ``D`` drafts with their offsets;
nothing is padded to the longest request. The output is ``[n, K + 1]`` token ids
(``K`` the most drafts of a request): accepted drafts, then the recovered or
bonus token, then ``PLACEHOLDER`` padding.
"""

import torch

from engine.spec_decode.metadata import VerifyMetadata

PLACEHOLDER = -1


def rejection_sample(
    target_probs: torch.Tensor,  # [R, V] processed p, request after request (k_r + 1 rows each)
    meta: VerifyMetadata,
    uniforms: torch.Tensor,  # [D] U[0, 1), one per draft
    noise: torch.Tensor,  # [n, V] Exp(1), for the recovered / bonus token
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(output_ids [n, K + 1], num_accepted [n])``."""
    ids, rows = meta.draft_token_ids, meta.target_logits_indices  # [D], [D]
    p_x = target_probs[rows, ids]  # [D]
    q_x = torch.ones_like(p_x) if meta.draft_probs is None else meta.draft_probs[torch.arange(len(ids), device=ids.device), ids]
    accept = uniforms * q_x < p_x  # [D] u < p/q without dividing by a zero q
    num_accepted = _first_rejection(accept, meta)  # [n]

    # The distribution of the extra token at row J: residual, or p itself at J = k (the
    # bonus row, and the one row of a request without drafts: drawn as plain sampling
    # draws it, not as p / sum(p), so that its bits do not depend on a neighbour's drafts).
    p_j = target_probs[meta.first_rows + num_accepted]  # [n, V]
    rejected = (num_accepted < meta.num_draft_tokens).unsqueeze(1)  # [n, 1]
    dist = torch.where(rejected, residual_distribution(p_j, _draft_row(meta, num_accepted, p_j)), p_j)
    extra = (dist / noise).argmax(dim=1)  # exponential race
    return _assemble(meta, num_accepted, extra), num_accepted


def _first_rejection(accept: torch.Tensor, meta: VerifyMetadata) -> torch.Tensor:
    """accept [D] -> [n] the index (within its request) of each request's first rejected
    draft, k_r when none is: the number of accepted drafts of a chain."""
    start = meta.draft_starts  # [n]
    pos = torch.arange(len(accept), device=accept.device) - start[meta.request_index]  # [D]
    # An accepted draft offers k_r, which changes no minimum: no boolean indexing (a host sync).
    offered = torch.where(accept, meta.num_draft_tokens[meta.request_index], pos)
    return meta.num_draft_tokens.clone().scatter_reduce(0, meta.request_index, offered, reduce="amin", include_self=True)


def _assemble(meta: VerifyMetadata, num_accepted: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """[n, K + 1]: the accepted drafts, the extra token, PLACEHOLDER padding."""
    k_max = meta.max_num_draft_tokens
    start = meta.draft_starts  # [n]
    pos = torch.arange(k_max + 1, device=extra.device).unsqueeze(0)  # [1, K + 1]
    src = (start.unsqueeze(1) + pos).clamp(max=max(len(meta.draft_token_ids) - 1, 0))  # [n, K + 1]
    drafts = meta.draft_token_ids[src] if len(meta.draft_token_ids) else torch.zeros_like(src)
    out = torch.where(pos < num_accepted.unsqueeze(1), drafts, PLACEHOLDER)
    return out.scatter_(1, num_accepted.unsqueeze(1), extra.unsqueeze(1))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``normalize(max(0, p - q))`` per row; ``p`` where p <= q everywhere (then a
    rejection cannot happen, so any choice is exact). [n, V] -> [n, V]."""
    residual = (p - q).clamp(min=0)
    mass = residual.sum(dim=1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)


def _draft_row(meta: VerifyMetadata, num_accepted: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """q at row J (the first rejected draft); zeros when J = k (bonus). [n, V]."""
    rejected = (num_accepted < meta.num_draft_tokens).unsqueeze(1)  # [n, 1]
    if len(meta.draft_token_ids) == 0:  # no drafts at all (a shape, known on the host)
        return torch.zeros_like(like)
    d = (meta.draft_starts + num_accepted).clamp(max=len(meta.draft_token_ids) - 1)  # [n] each request's draft J
    if meta.draft_probs is None:
        q = torch.zeros_like(like).scatter_(1, meta.draft_token_ids[d].unsqueeze(1), 1.0)
    else:
        q = meta.draft_probs[d]
    return torch.where(rejected, q, 0.0)  # masks, not boolean indexing: no host sync
