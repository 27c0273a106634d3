"""Reference attention over the paged KV cache, in plain torch.

Every other backend is tested against this one. It writes the step's new K/V
into their slots, then gathers each request's keys and values through its
block table and runs scaled-dot-product attention with an explicit mask; or, for
metadata built with ``listed=True`` (the ``cpu`` backend), attends every query with
a C kernel straight from the cache, with no gather or padding.
"""

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata
from engine.layers import cpu_kernels


def paged_attention(q, k, v, kv_layer, meta: AttentionMetadata) -> torch.Tensor:
    """q [T, H, D], k and v [T, KVH, D] (new tokens) -> [T, H, D].

    ``kv_layer`` is ``(k_cache, v_cache)``, each [num_blocks, block_size, KVH, D].
    """
    k_cache, v_cache = kv_layer
    k_flat = k_cache.view(-1, *k_cache.shape[2:])  # [num_slots, KVH, D]
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    if meta.listed is not None:
        ls = meta.listed
        cpu_kernels.paged_attention(q, k_flat, v_flat, ls.rows, ls.start, ls.length, ls.slots, out)
    for s in meta.solo:
        qs = q[s.start : s.end].transpose(0, 1)  # [H, m, D]
        if s.kv_span is not None:
            ks, vs = k_flat.narrow(0, *s.kv_span), v_flat.narrow(0, *s.kv_span)
        elif s.kv_slots is not None:
            ks, vs = k_flat.index_select(0, s.kv_slots), v_flat.index_select(0, s.kv_slots)
        else:
            ks, vs = k[s.start : s.end], v[s.start : s.end]
        o = F.scaled_dot_product_attention(  # 4-D: CPU kernels for 3-D inputs are several times slower
            qs[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
            attn_mask=s.mask, is_causal=s.causal, enable_gqa=True,
        )[0]
        out[s.start : s.end] = o.transpose(0, 1)
    for b in meta.batched:
        n, max_q = b.token_index.shape
        max_kv = b.kv_slots.shape[1]
        qb = q.index_select(0, b.token_index.view(-1)).view(n, max_q, *q.shape[1:]).transpose(1, 2)
        kb = k_flat.index_select(0, b.kv_slots.view(-1)).view(n, max_kv, *k.shape[1:]).transpose(1, 2)
        vb = v_flat.index_select(0, b.kv_slots.view(-1)).view(n, max_kv, *v.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.mask, enable_gqa=True)
        o = o.transpose(1, 2).reshape(n * max_q, *q.shape[1:])  # [n * max_q, H, D]
        if b.rows_are_tokens:
            return o  # the one batch holds every token of the step, in order
        out.index_copy_(0, b.valid_tokens, o.index_select(0, b.valid_rows))
    return out
