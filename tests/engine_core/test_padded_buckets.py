"""Padded buckets are neutral (engine.worker.step_buffers): with the C kernels (the ``cpu`` backend,
each layer one C call, outside autograd as in the runner), a step of decodes, chains of
drafts of mixed lengths or a short prompt, padded to its bucket and run on the static buffers, gives
the real rows' hidden states and logits bitwise equal to the same step unpadded, writes the
same keys and values at the real rows' slots, and leaves every other slot of the manager's
blocks untouched (padding rows write only the padding block)."""

import numpy as np
import pytest
import torch

from engine.attention import SeqSpec
from engine.attention.backends import CPU
from engine.worker.cuda_graphs import BucketedForward
from engine.layers import cpu_kernels
from engine.worker.step_buffers import Bucket, bucket_for, make_buckets
from kvcache.tensors import KVSpec, PagedKV

BLOCK = 16
NUM_BLOCKS = 24
MAX_LEN = 128

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C kernels on this machine")


@pytest.fixture
def model(tiny_model, monkeypatch):
    decoder_layer = cpu_kernels.decoder_layer
    m = tiny_model(vocab_size=256, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    m.prepack()
    assert m.fused is not None  # the whole-layer C calls run
    calls = []
    monkeypatch.setattr(cpu_kernels, "decoder_layer", lambda *a, **k: calls.append(1) or decoder_layer(*a, **k))
    m.fused_calls = calls
    return m


@torch.inference_mode()
def prefilled(model, contexts: list[int], tables: list[list[int]]) -> PagedKV:
    """A KV cache holding ``contexts[r]`` random tokens of request r (one unpadded prefill)."""
    contexts, tables = zip(*[(c, t) for c, t in zip(contexts, tables) if c])  # requests with a context
    cfg = model.config
    kv = PagedKV(KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, BLOCK, torch.float32), NUM_BLOCKS,
                 "cpu", pad_block=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (sum(contexts),), generator=g)
    pos = torch.cat([torch.arange(c) for c in contexts])
    model(ids, pos, CPU.build_metadata([SeqSpec(0, c, t) for c, t in zip(contexts, tables)], BLOCK, "cpu"), kv)
    return kv


def tables_of(contexts: list[int], q: int) -> list[list[int]]:
    """Scattered, disjoint block tables (not in order: slots map through the table)."""
    perm = np.random.default_rng(0).permutation(NUM_BLOCKS).tolist()
    tables = []
    for c in contexts:
        n = -(-(c + q) // BLOCK)
        tables.append(perm[:n])
        perm = perm[n:]
    return tables


CASES = {  # query lengths, context lengths: decodes, chains of drafts, mixed lengths, a short prompt
    "decode-1": ([1], [33]), "decode-3": ([1] * 3, [5, 40, 17]), "decode-5": ([1] * 5, [5, 9, 4, 1, 2]),
    "chain-3x1": ([3], [70]), "chains-2x2": ([2, 2], [15, 16]), "chains-3x3": ([3] * 3, [5, 9, 4]),
    "chains-4x5": ([4] * 5, [9, 30, 16, 3, 50]), "mixed-2": ([3, 1], [5, 9]), "mixed-3": ([2, 1, 1], [5, 9, 3]),
    "mixed-5": ([1, 4, 2, 3, 1], [12, 31, 64, 7, 20]), "with-a-prompt": ([3, 1], [0, 9]),
}


@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()  # as the runner: the C kernels run outside autograd
def test_padded_step_is_bitwise_the_unpadded_one(model, case):
    qlens, contexts = CASES[case]
    tables = tables_of(contexts, max(qlens))
    specs = [SeqSpec(c, q, t) for c, q, t in zip(contexts, qlens, tables)]
    ids = np.random.default_rng(2).integers(0, 256, sum(qlens))
    positions = np.concatenate([c + np.arange(q) for c, q in zip(contexts, qlens)])
    eager_kv, padded_kv = prefilled(model, contexts, tables), prefilled(model, contexts, tables)
    before = [t.clone() for t in padded_kv.k + padded_kv.v]
    model.fused_calls.clear()

    meta = CPU.build_metadata(specs, BLOCK, "cpu")
    eager = model(torch.from_numpy(ids), torch.from_numpy(positions), meta, eager_kv)
    runner = BucketedForward(model, "cpu", padded_kv, MAX_LEN, "cpu", max_requests=8, max_tokens=4, graphs=False)
    bucket = runner.bucket_for(specs)
    padding = bucket.num_tokens - sum(qlens)
    padded = runner.forward(bucket, specs, ids)
    assert len(model.fused_calls) == 2 * model.config.num_hidden_layers  # both steps through the C layer

    assert torch.equal(padded, eager)
    assert torch.equal(model.compute_logits(padded), model.compute_logits(eager))
    written = meta.slot_mapping  # the real rows' slots
    outside = torch.ones(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    outside[written] = False
    for cache, eager_cache, old in zip(padded_kv.k + padded_kv.v, eager_kv.k + eager_kv.v, before):
        flat, eager_flat, old_flat = (t[:NUM_BLOCKS].flatten(0, 1) for t in (cache, eager_cache, old))
        assert torch.equal(flat[written], eager_flat[written])
        assert torch.equal(flat[outside], old_flat[outside])  # nothing else of the manager's blocks moved
        assert torch.equal(cache[NUM_BLOCKS], old[NUM_BLOCKS]) == (padding == 0)  # padding wrote its block only


def test_buckets():
    buckets = make_buckets(max_requests=5, max_tokens=3)
    assert {(b.requests, b.tokens) for b in buckets} == {(r, q) for r in (1, 2, 4, 8) for q in (1, 2, 3)}
    assert buckets[0] == Bucket(8, 3)  # captured first: the others reuse its memory
    decode = [SeqSpec(4, 1, [0]), SeqSpec(9, 1, [1]), SeqSpec(2, 1, [2])]
    assert bucket_for(decode, buckets) == Bucket(4, 1)
    assert bucket_for(decode * 3, buckets) is None  # more requests than the largest bucket: eager
    assert bucket_for([SeqSpec(4, 1, [0]), SeqSpec(4, 2, [1])], buckets) == Bucket(2, 2)  # mixed lengths
    assert bucket_for([SeqSpec(0, 3, [0])], buckets) == Bucket(1, 3)  # a short prompt
    assert bucket_for([SeqSpec(4, 3, [0], (-1, 0, 0))], buckets) is None  # a tree
    assert bucket_for([SeqSpec(4, 4, [0])], buckets) is None  # longer than any bucket
