"""Gemma 2's soft-capped attention on the ``cpu`` backend (listed queries through
``eager``) is bitwise batch invariant, as docs/cpu.md promises for that backend: row 0
of a verification chain, beside other requests, has the bits of the same decode alone."""

import pytest
import torch

from engine.attention import SeqSpec, build_attention_metadata, paged_attention

H, KVH, D, BLOCK = 4, 2, 32, 4
SOFTCAP = 3.0


def attend(specs: list[SeqSpec], cache, q, k, v, window=None) -> torch.Tensor:
    meta = build_attention_metadata(specs, BLOCK, listed=True, window=window)
    kv = tuple(c.clone() for c in cache)
    return paged_attention(q, k, v, kv, meta, scale=D ** -0.5, softcap=SOFTCAP)


@pytest.mark.parametrize("context", [5, 63, 64, 100])
@pytest.mark.parametrize("window", [None, 40])
def test_row_0_of_a_chain_beside_others_has_the_bits_of_the_decode_alone(context, window):
    g = torch.Generator().manual_seed(context)
    cache = tuple(torch.randn(80, BLOCK, KVH, D, generator=g) for _ in range(2))  # 320 slots
    q, k, v = torch.randn(3 + 1 + 20, H, D, generator=g), *torch.randn(2, 24, KVH, D, generator=g)
    table = list(range(0, 40))  # the request's blocks; the neighbours' below
    alone = attend([SeqSpec(context, 1, table)], cache, q[:1], k[:1], v[:1], window)
    chain = [SeqSpec(context, 3, table), SeqSpec(130, 1, list(range(40, 73))), SeqSpec(7, 20, list(range(73, 80)))]
    together = attend(chain, cache, q, k, v, window)
    assert torch.equal(together[0], alone[0])
