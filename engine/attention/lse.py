"""Attention in parts, merged by log-sum-exp (the merge flash-decoding uses for its splits).

Attention of one query row over keys ``A ∪ B`` (disjoint) is the softmax-weighted
mix of its attention over ``A`` alone and over ``B`` alone::

    lse   = log(exp(lse_a) + exp(lse_b))
    out   = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

where ``lse_x`` is the log of the softmax denominator over ``x`` (the natural-log
sum of ``exp(q·k * scale)``). A part with no visible key has ``lse = -inf`` and
weight 0. Token trees use it: the committed prefix is one part (a fast kernel,
no mask), the tree's own nodes the other (a small dense attention with the tree
mask).
"""

import torch


def merge_attention(out_a, lse_a, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """out_* [N, H, D] (any float dtype), lse_* [N, H] float32 -> (out [N, H, D] in
    out_a's dtype, lse [N, H] float32). At least one of the two parts must see a key."""
    lse = torch.logaddexp(lse_a, lse_b)  # [N, H]
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)  # [N, H, 1]; 0 where lse_a = -inf
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    out = out_a.float() * w_a + out_b.float() * w_b
    return out.to(out_a.dtype), lse


def masked_attention_lse(q, k, v, mask, scale: float, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded batched attention with an explicit mask, returning its log-sum-exp.

    q [n, mq, H, D]; k, v [n, mk, KVH, D] (H a multiple of KVH: grouped-query heads
    share their KV head without copying it); mask [n, mq, mk] bool, True = attend.
    ``softcap``: the scores become ``softcap * tanh(scores / softcap)`` (Gemma 2).
    Returns out [n, mq, H, D] in q's dtype and lse [n, mq, H] float32. A row that
    sees no key gets out 0 and lse -inf (as flash-attn does).
    """
    n, mq, num_heads, d = q.shape
    mk, kvh = k.shape[1], k.shape[2]
    g = num_heads // kvh
    # Contiguous operands: a strided one can take another matmul path at n = 1, so that a row's
    # bits would depend on the row count.
    qg = q.reshape(n, mq, kvh, g, d).permute(0, 2, 1, 3, 4).reshape(n, kvh, mq * g, d)  # rows (query, group)
    qg = qg.float().contiguous()
    kg, vg = k.permute(0, 2, 1, 3).float().contiguous(), v.permute(0, 2, 1, 3).float().contiguous()  # [n, KVH, mk, D]
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # [n, KVH, mq * g, mk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = mask[:, None, :, None, :].expand(n, 1, mq, g, mk).reshape(n, 1, mq * g, mk)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [n, KVH, mq * g]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)  # rows with no key: exp(nan) -> 0
    out = torch.matmul(probs, vg)  # [n, KVH, mq * g, D]
    out = out.reshape(n, kvh, mq, g, d).permute(0, 2, 1, 3, 4).reshape(n, mq, num_heads, d)
    lse = lse.reshape(n, kvh, mq, g).permute(0, 2, 1, 3).reshape(n, mq, num_heads)
    return out.to(q.dtype), lse
