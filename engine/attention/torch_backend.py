"""Reference attention over the paged KV cache, in plain torch.

Every other backend is tested against this one. It writes the step's new K/V
into their slots, then gathers each request's keys and values through its
block table and runs scaled-dot-product attention with an explicit mask; or, for
metadata built with ``listed=True`` (the ``cpu`` backend), attends every query with
a C kernel straight from the cache, with no gather or padding.
"""

import torch
import torch.nn.functional as F

from engine.attention.lse import masked_attention_lse
from engine.attention.metadata import AttentionMetadata, ListedQueries
from engine.layers import cpu_kernels

LISTED_EAGER_ROWS = 64  # listed tokens attended together by ``_listed_eager`` (bounds its padded gather)
LISTED_EAGER_KEYS = 64  # ``_listed_eager`` pads a token's keys to a multiple of this


def paged_attention(q, k, v, kv_layer, meta: AttentionMetadata, scale: float | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q [T, H, D], k and v [T, KVH, D] (new tokens) -> [T, H, D].

    ``kv_layer`` is ``(k_cache, v_cache)``, each [num_blocks, block_size, KVH, D], of q's dtype or
    lower (``--kv-cache-dtype``): the new keys and values are rounded to it at the write, and
    every key and value is read back as q's dtype, the new ones too, as if read from the cache. ``scale``:
    the softmax scale (default 1/sqrt(D)); ``softcap``: scores become ``softcap * tanh(s / softcap)``
    (Gemma 2), which neither SDPA nor the C kernels do: then every query goes through ``eager``.
    """
    k_cache, v_cache = kv_layer
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, KVH, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)  # as the cache holds them
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    scale = scale or q.shape[-1] ** -0.5
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    if meta.listed is not None:
        ls = meta.listed
        if softcap is None:
            cpu_kernels.paged_attention(q, k_flat, v_flat, ls.rows, ls.start, ls.length, ls.slots, out, scale)
        else:
            _listed_eager(q, k_flat, v_flat, ls, scale, softcap, out)
    for s in meta.solo:
        if s.kv_span is not None:
            ks, vs = k_flat.narrow(0, *s.kv_span), v_flat.narrow(0, *s.kv_span)
        elif s.kv_slots is not None:
            ks, vs = k_flat.index_select(0, s.kv_slots), v_flat.index_select(0, s.kv_slots)
        else:
            ks, vs = k[s.start : s.end], v[s.start : s.end]
        ks, vs = ks.to(q.dtype), vs.to(q.dtype)
        if softcap is not None:
            mask = s.mask if s.mask is not None else _full_mask(s.end - s.start, ks.shape[0], s.causal, q.device)
            out[s.start : s.end] = eager(q[s.start : s.end][None], ks[None], vs[None], mask[None], scale, softcap)[0]
            continue
        o = F.scaled_dot_product_attention(  # 4-D: CPU kernels for 3-D inputs are several times slower
            q[s.start : s.end].transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
            attn_mask=s.mask, is_causal=s.causal, enable_gqa=True, scale=scale,
        )[0]
        out[s.start : s.end] = o.transpose(0, 1)
    for b in meta.batched:
        n, max_q = b.token_index.shape
        max_kv = b.kv_slots.shape[1]
        qb = q.index_select(0, b.token_index.view(-1)).view(n, max_q, *q.shape[1:])  # [n, max_q, H, D]
        kb = k_flat.index_select(0, b.kv_slots.view(-1)).view(n, max_kv, *k.shape[1:]).to(q.dtype)  # [n, max_kv, KVH, D]
        vb = v_flat.index_select(0, b.kv_slots.view(-1)).view(n, max_kv, *v.shape[1:]).to(q.dtype)
        if softcap is None:
            o = F.scaled_dot_product_attention(qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
                                               attn_mask=b.mask, enable_gqa=True, scale=scale).transpose(1, 2)
        else:
            o = eager(qb, kb, vb, b.mask[:, 0], scale, softcap)
        o = o.reshape(n * max_q, *q.shape[1:])  # [n * max_q, H, D]
        if b.rows_are_tokens:
            return o  # the one batch holds every token of the step, in order
        out.index_copy_(0, b.valid_tokens, o.index_select(0, b.valid_rows))
    return out


def eager(q, k, v, mask, scale: float, softcap: float | None) -> torch.Tensor:
    """Attention with an explicit mask and optional soft-capped scores: q [n, mq, H, D],
    k and v [n, mk, KVH, D], mask [n, mq, mk] bool -> [n, mq, H, D]."""
    return masked_attention_lse(q, k, v, mask, scale, softcap)[0]


def _full_mask(m: int, kv_len: int, causal: bool, device) -> torch.Tensor:
    """[m, kv_len]: causal over m new tokens with no context, or every key visible."""
    ones = torch.ones(m, kv_len, dtype=torch.bool, device=device)
    return torch.tril(ones) if causal else ones


def _listed_eager(q, k_flat, v_flat, ls: ListedQueries, scale: float, softcap: float, out) -> None:
    """The listed queries through ``eager`` into ``out`` [T, H, D]: grouped by their list's length
    rounded up to ``LISTED_EAGER_KEYS``, each group padded to that length, ``LISTED_EAGER_ROWS``
    at a time. A row's shapes then depend on its own list only, so its bits do not depend on
    its neighbours (``eager``'s ops give a row the same bits at any row count)."""
    padded = (ls.length + LISTED_EAGER_KEYS - 1) // LISTED_EAGER_KEYS * LISTED_EAGER_KEYS  # [N]
    for size in padded.unique().tolist():
        group = (padded == size).nonzero().squeeze(1)  # [n] listed entries of this length
        j = torch.arange(size, device=q.device)  # [L]
        for first in range(0, group.shape[0], LISTED_EAGER_ROWS):
            part = group[first : first + LISTED_EAGER_ROWS]
            rows, start, length = ls.rows[part], ls.start[part], ls.length[part]  # [n] each
            visible = j[None, :] < length[:, None]  # [n, L]
            idx = ls.slots[(start[:, None] + j[None, :]).clamp(max=ls.slots.shape[0] - 1)]  # [n, L] slots
            kl, vl = k_flat[idx].to(q.dtype), v_flat[idx].to(q.dtype)  # [n, L, KVH, D]
            out[rows] = eager(q[rows][:, None], kl, vl, visible[:, None, :], scale, softcap)[:, 0]
