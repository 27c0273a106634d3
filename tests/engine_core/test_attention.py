"""Attention metadata (trees, slot mapping) and the torch paged-attention
backend against a dense reference attention written here."""

import numpy as np
import pytest
import torch

from engine.attention import SeqSpec, build_attention_metadata, paged_attention, tree_mask
from engine.attention.metadata import MAX_BATCHED_QUERY
from engine.utils import tree
from bench.attention_problems import dense_attention


def test_tree_mask_hand_drawn():
    #        root0
    #       /     \
    #    node1   node2
    #     |
    #    node3
    mask = tree_mask((-1, 0, 0, 1))
    assert mask.astype(int).tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 0, 1, 0],
        [1, 1, 0, 1],
    ]
    assert tree.depths((-1, 0, 0, 1)).tolist() == [0, 1, 1, 2]  # the runner's positions: prefix + depth


def test_tree_mask_chain_is_causal_and_forest_roots_are_independent():
    assert (tree_mask((-1, 0, 1, 2)) == np.tri(4, dtype=bool)).all()
    # Two roots (two alternative first tokens), the second with a child.
    assert tree_mask((-1, -1, 1)).astype(int).tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    assert tree.depths((-1, -1, 1)).tolist() == [0, 0, 1]


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-1, 2, 0)])
def test_tree_mask_rejects_parent_not_before_child(parents):
    with pytest.raises(ValueError):
        tree_mask(parents)


def test_metadata_slot_mapping_worked_example():
    # r0: prefill of 3 into blocks [5]; r1: decode at position 4 of blocks [2, 9];
    # r2: chain of 2 at positions 3, 4 of blocks [1, 0]. block_size 4.
    specs = [SeqSpec(0, 3, [5]), SeqSpec(4, 1, [2, 9]), SeqSpec(3, 2, [1, 0])]
    meta = build_attention_metadata(specs, block_size=4)
    assert meta.slot_mapping.tolist() == [20, 21, 22, 36, 7, 0]
    assert meta.batched == []  # each alone in its query-length bucket (1, 2, 3-4 tokens)
    r0, r1, r2 = sorted(meta.solo, key=lambda q: q.start)
    assert (r0.start, r0.end, r0.causal, r0.mask) == (0, 3, True, None)  # no context: plain causal
    assert r1.kv_slots.tolist() == [8, 9, 10, 11, 36] and r1.mask is None and not r1.causal  # sees all
    assert r2.kv_span is None and r2.kv_slots.tolist() == [4, 5, 6, 7, 0]
    # Chain rule: row i sees positions 0 .. context_len + i.
    assert r2.mask.int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    contiguous = build_attention_metadata([SeqSpec(4, 1, [6, 7])], block_size=4).solo[0]
    assert contiguous.kv_span == (24, 5) and contiguous.kv_slots is None  # a view of slots 24..28


def test_requests_of_one_bucket_are_padded_to_its_longest_query():
    specs = [SeqSpec(0, 3, [5]), SeqSpec(4, 1, [2, 9]), SeqSpec(3, 4, [1, 0])]
    b = build_attention_metadata(specs, block_size=4).batched[0]  # 3 and 4 tokens; the decode is alone
    assert b.token_index.shape == (2, 4)
    assert b.valid.tolist() == [[True, True, True, False], [True, True, True, True]]
    assert b.token_index[b.valid].tolist() == [0, 1, 2, 4, 5, 6, 7]


def test_metadata_tree_mask_in_batch_and_long_queries_alone():
    parents = (-1, 0, 0, 1)
    long = MAX_BATCHED_QUERY + 1
    specs = [
        SeqSpec(2, 4, [3, 0], parents),
        SeqSpec(0, long, list(range(4, 4 + long // 4 + 1))),
        SeqSpec(1, 3, [1]),  # shares the tree's bucket (3-4 tokens), so both are batched
    ]
    meta = build_attention_metadata(specs, block_size=4)
    assert len(meta.solo) == 1 and (meta.solo[0].start, meta.solo[0].end) == (4, 4 + long)
    mask = meta.batched[0].mask[0, 0, :4, :6].int()
    expected = np.ones((4, 6), dtype=int)
    expected[:, 2:] = tree_mask(parents)
    assert mask.tolist() == expected.tolist()


# ---- paged attention against a dense reference ----


CASES = [  # (context_len, query_len, parents or None for a chain)
    (0, MAX_BATCHED_QUERY + 6, None),  # long prefill, alone, no context
    (10, MAX_BATCHED_QUERY + 2, None),  # long chunk after a context, alone
    (3, MAX_BATCHED_QUERY + 3, "random tree"),  # a long tree, alone
    (0, 5, None),  # short prefill, batched
    (23, 1, None),  # decode
    (7, 4, None),  # chain of drafts
    (13, 6, (-1, 0, 0, 1, 1, 2)),  # small tree
    (5, 3, (-1, -1, 1)),  # forest: two roots
]


@pytest.mark.parametrize("contiguous", [False, True], ids=["scattered-blocks", "contiguous-blocks"])
def test_paged_attention_matches_dense_reference(contiguous):
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    num_heads, num_kv_heads, d, block_size = 4, 2, 8, 4
    specs, qs, ks, vs, refs = [], [], [], [], []
    need = [-(-(c + m) // block_size) for c, m, _ in CASES]
    order = rng.permutation(sum(need) + 3).tolist()  # scattered blocks: gathered through slots
    if contiguous:  # each request's blocks in a row: read as a view of the cache
        order = list(range(sum(need) + 3))
    num_blocks = len(order)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, d, generator=gen)  # garbage where unused
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, d, generator=gen)
    for (c, m, parents), n in zip(CASES, need, strict=True):
        table, order = order[:n], order[n:]
        if parents == "random tree":
            parents = tuple(int(rng.integers(-1, i)) for i in range(m))
        k = torch.randn(c + m, num_kv_heads, d, generator=gen)
        v = torch.randn(c + m, num_kv_heads, d, generator=gen)
        q = torch.randn(m, num_heads, d, generator=gen)
        for pos in range(c):  # the context is already in the cache
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        specs.append(SeqSpec(c, m, table, parents))
        qs.append(q), ks.append(k[c:]), vs.append(v[c:])
        refs.append(dense_attention(q, k, v, c, parents or tuple(range(-1, m - 1))))
    meta = build_attention_metadata(specs, block_size)
    assert len(meta.solo) == 4 and len(meta.batched) == 2  # the decode is alone in its bucket
    with_context = [q for q in meta.solo if q.kv_slots is not None or q.kv_span is not None]
    assert all((q.kv_span is not None) == contiguous for q in with_context) and len(with_context) == 3
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), (k_cache, v_cache), meta)
    torch.testing.assert_close(out.double(), torch.cat(refs), atol=1e-5, rtol=1e-5)
    # The new K/V were written to their slots.
    flat_k = k_cache.view(-1, num_kv_heads, d)
    flat_v = v_cache.view(-1, num_kv_heads, d)
    assert torch.equal(flat_k[meta.slot_mapping], torch.cat(ks))
    assert torch.equal(flat_v[meta.slot_mapping], torch.cat(vs))
