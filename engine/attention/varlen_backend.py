"""The varlen backends: flash-attn 2.x over the paged KV cache, and its torch stand-in.

One forward (``paged_attention``) serves both; only the kernel differs:

- ``flash_kernel``: ``flash_attn_varlen_func`` with ``block_table`` (flash-attn's
  paged-KV path, which requires a KV block size divisible by 256) and
  ``return_attn_probs=True`` for its log-sum-exp;
- ``torch_kernel``: the same contract in plain torch (gather the paged KV, explicit
  mask, fp32 softmax). It is the CUDA fallback when flash-attn is not installed,
  and, on the CPU, the stand-in that runs every line of the flash path but the
  flash call itself in the tests.

Trees: the committed prefix through the kernel with its log-sum-exp, the tree's
own nodes through ``masked_attention_lse``, merged by ``merge_attention``.
"""

import torch

from engine.attention.lse import masked_attention_lse, merge_attention
from engine.attention.varlen_metadata import KVCacheStep, VarlenGroup, VarlenMetadata

# flash-attn's paged KV (``block_table``) requires page_block_size % 256 == 0
# (csrc/flash_attn/flash_api.cpp, mha_varlen_fwd and mha_fwd_kvcache, v2.8.3).
FLASH_BLOCK_SIZE_MULTIPLE = 256


def paged_attention(q, k, v, kv_layer, meta: VarlenMetadata, scale: float | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q [T, H, D], k and v [T, KVH, D] (new tokens) -> [T, H, D].

    ``kv_layer`` is ``(k_cache, v_cache)``, each [num_blocks, block_size, KVH, D];
    the new K/V are written to their slots first (rounded to the cache's dtype), then read
    back through the cache (``torch_kernel`` and the tree's own nodes: as q's dtype).
    ``scale``: the softmax scale (default 1/sqrt(D)); ``softcap``: Gemma 2's score cap.
    """
    k_cache, v_cache = kv_layer
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)  # as the cache holds them
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, meta.slot_mapping, v)
    scale = scale or q.shape[-1] ** -0.5
    out = None if len(meta.groups) == 1 and meta.groups[0].token_index is None else torch.empty_like(q)
    for g in meta.groups:
        qg = q if g.token_index is None else q.index_select(0, g.token_index)
        o, _ = meta.kernel(qg, k_cache, v_cache, g, scale, softcap)
        if out is None:
            out = o  # the one group holds every token of the step, in order
        else:
            out.index_copy_(0, g.token_index, o)
    if meta.tree is not None:
        out.index_copy_(0, meta.tree.valid_tokens, tree_attention(q, k, v, k_cache, v_cache, meta, scale, softcap))
    return out


def tree_attention(q, k, v, k_cache, v_cache, meta: VarlenMetadata, scale: float, softcap=None) -> torch.Tensor:
    """Attention of every tree node: [num_nodes, H, D], nodes request by request."""
    t = meta.tree
    n, max_m = t.token_index.shape
    out_prefix = q.new_zeros(q.shape)  # [T, H, D], by flat token: the prefix part of each node
    lse_prefix = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)  # [T, H]
    for g in meta.tree_prefixes:
        o, lse = meta.kernel(q.index_select(0, g.token_index), k_cache, v_cache, g, scale, softcap)
        out_prefix.index_copy_(0, g.token_index, o)
        lse_prefix.index_copy_(0, g.token_index, lse)
    out_prefix, lse_prefix = out_prefix.index_select(0, t.valid_tokens), lse_prefix.index_select(0, t.valid_tokens)
    # A node with no committed key in sight has no prefix part (flash-attn reports lse +inf there).
    lse_prefix = lse_prefix.masked_fill(~t.has_prefix[:, None], float("-inf"))
    flat = t.token_index.view(-1)
    qt = q.index_select(0, flat).view(n, max_m, *q.shape[1:])
    kt = k.index_select(0, flat).view(n, max_m, *k.shape[1:])
    vt = v.index_select(0, flat).view(n, max_m, *v.shape[1:])
    out_tree, lse_tree = masked_attention_lse(qt, kt, vt, t.mask, scale, softcap)  # [n, max_m, H, D], [n, max_m, H]
    out_tree = out_tree.view(n * max_m, *q.shape[1:]).index_select(0, t.valid_rows)
    lse_tree = lse_tree.view(n * max_m, -1).index_select(0, t.valid_rows)
    out, _ = merge_attention(out_tree, lse_tree, out_prefix, lse_prefix)
    return out


def flash_kernel(q, k_cache, v_cache, g: VarlenGroup, scale: float, softcap: float | None = None):
    """flash-attn 2.x varlen attention over the paged cache. NEVER RUN in this project
    (no GPU with flash-attn yet): its arguments follow flash_attn_interface.py (``softcap``
    and ``window_size`` since 2.6)."""
    from flash_attn import flash_attn_varlen_func

    window = (g.window_left, 0) if g.window_left >= 0 else (-1, -1)
    out, lse, _ = flash_attn_varlen_func(
        q, k_cache, v_cache, g.cu_seqlens_q, g.cu_seqlens_k, g.max_seqlen_q, g.max_seqlen_k,
        softmax_scale=scale, causal=g.causal, window_size=window, softcap=softcap or 0.0,
        return_attn_probs=True, block_table=g.block_table,
    )
    return out, lse.transpose(0, 1)  # flash's softmax_lse is [H, num_q]


def kvcache_attention(q, k, v, kv_layer, step: KVCacheStep, cos, sin, window: int | None = None,
                      scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, H, D], k and v [T, KVH, D], not yet rotated -> [T, H, D]: rope on q and k, the K/V
    append at ``step.cache_seqlens`` and causal attention in one ``flash_attn_with_kvcache``
    call. ``cos``/``sin``: the rope's half tables [rows, D / 2] in q's dtype, rows at least the
    block table's reach; token i of a request sits at position context_len + i. NEVER RUN on a
    GPU in this project: its arguments follow flash_attn_interface.py (v2.8.3)."""
    from flash_attn import flash_attn_with_kvcache

    k_cache, v_cache = kv_layer
    b, m = step.cache_seqlens.shape[0], step.query_len
    out = flash_attn_with_kvcache(
        q.view(b, m, *q.shape[1:]), k_cache, v_cache, k=k.view(b, m, *k.shape[1:]), v=v.view(b, m, *v.shape[1:]),
        rotary_cos=cos, rotary_sin=sin, cache_seqlens=step.cache_seqlens, block_table=step.block_table,
        softmax_scale=scale, causal=True, window_size=(window - 1, 0) if window else (-1, -1),
        softcap=softcap or 0.0, rotary_interleaved=False,
    )  # [b, m, H, D]
    return out.view(q.shape)


def torch_kernel(q, k_cache, v_cache, g: VarlenGroup, scale: float, softcap: float | None = None):
    """``flash_kernel``'s contract in plain torch: requests padded to the group's longest
    query and KV (so groups should be bucketed by query length), with no host sync."""
    device, n = q.device, g.block_table.shape[0]
    block_size = k_cache.shape[1]
    q_len = (g.cu_seqlens_q[1:] - g.cu_seqlens_q[:-1]).long()  # [n]
    kv_len = (g.cu_seqlens_k[1:] - g.cu_seqlens_k[:-1]).long()
    rows = torch.arange(g.max_seqlen_q, device=device)  # [max_q]
    q_index = g.cu_seqlens_q[:-1, None].long() + torch.minimum(rows[None, :], q_len[:, None] - 1)  # [n, max_q]
    pos = torch.arange(max(g.max_seqlen_k, 1), device=device)  # [max_k]
    blocks = g.block_table.long().gather(1, (pos // block_size).expand(n, -1))  # [n, max_k]
    slots = (blocks * block_size + pos % block_size).view(-1)
    k_flat, v_flat = k_cache.view(-1, *k_cache.shape[2:]), v_cache.view(-1, *v_cache.shape[2:])
    kb = k_flat.index_select(0, slots).view(n, len(pos), *k_cache.shape[2:])  # [n, max_k, KVH, D]
    vb = v_flat.index_select(0, slots).view(n, len(pos), *v_cache.shape[2:])
    mask = pos[None, None, :] < kv_len[:, None, None]  # [n, 1, max_k]
    diagonal = (kv_len - q_len)[:, None, None] + rows[None, :, None]  # [n, max_q, 1]: row i's own position
    if g.causal:  # bottom-right: row i sees positions <= kv_len - q_len + i
        mask = mask & (pos[None, None, :] <= diagonal)
    if g.window_left >= 0:
        mask = mask & (pos[None, None, :] >= diagonal - g.window_left)
    mask = mask.expand(n, g.max_seqlen_q, -1)
    qg = q.index_select(0, q_index.view(-1)).view(n, g.max_seqlen_q, *q.shape[1:])
    out, lse = masked_attention_lse(qg, kb, vb, mask, scale, softcap)
    # Query row j of the group is row j - cu_seqlens_q[r] of its request r.
    j = torch.arange(q.shape[0], device=device)
    req = torch.searchsorted(g.cu_seqlens_q[1:].long(), j, right=True)
    padded = req * g.max_seqlen_q + j - g.cu_seqlens_q[:-1].long()[req]  # [num_q]
    return out.view(-1, *q.shape[1:]).index_select(0, padded), lse.view(-1, q.shape[1]).index_select(0, padded)
