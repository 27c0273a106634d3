"""Random paged-attention problems, and a float64 reference of the varlen kernel
contract: what ``bench.gpu_check`` runs the backends against on a GPU, and what the
CPU backend tests and the gpu-marked ones check them with."""

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import SeqSpec
from engine.attention.metadata import MAX_BATCHED_QUERY

CASES = [  # (context_len, query_len, parents, "random tree", or None for a chain)
    (0, MAX_BATCHED_QUERY + 6, None),  # long prefill, no context
    (10, MAX_BATCHED_QUERY + 2, None),  # long chunk after a context
    (3, MAX_BATCHED_QUERY + 3, "random tree"),  # a long tree
    (0, 5, None),  # short prefill
    (23, 1, None),  # decode
    (30, 1, None),  # another decode: batched with the first
    (7, 4, None),  # chain of drafts
    (13, 6, (-1, 0, 0, 1, 1, 2)),  # small tree
    (5, 3, (-1, -1, 1)),  # forest: two roots
    (0, 3, (-1, 0, 0)),  # a tree with no committed context
]


@dataclass
class Problem:
    specs: list[SeqSpec]
    q: torch.Tensor  # [T, H, D] new tokens of every request, in order
    k: torch.Tensor  # [T, KVH, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D], context already written
    v_cache: torch.Tensor
    reference: torch.Tensor  # [T, H, D] float64, dense attention


def ancestors_or_self(parents, i):
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def depth_of(parents, i) -> int:
    return len(ancestors_or_self(parents, i)) - 1


def dense_attention(q, k, v, context_len, parents, window=None, scale=None, softcap=None):
    """q [m, H, D]; k, v [context_len + m, KVH, D] -> [m, H, D], in float64. A new token's
    position is context_len + its depth; with a ``window`` it sees keys less than ``window``
    positions back; ``softcap``: scores become softcap * tanh(score / softcap)."""
    m, num_heads, d = q.shape
    group = num_heads // k.shape[1]
    scale = scale or d**-0.5
    out = torch.empty(m, num_heads, d, dtype=torch.float64)
    for i in range(m):
        pos = context_len + depth_of(parents, i)
        visible = [j for j in range(context_len) if window is None or pos - j < window]
        visible += [context_len + j for j in sorted(ancestors_or_self(parents, i))
                    if window is None or pos - (context_len + depth_of(parents, j)) < window]
        for h in range(num_heads):
            keys, vals = k[visible, h // group].double(), v[visible, h // group].double()
            s = keys @ q[i, h].double() * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[i, h] = torch.softmax(s, dim=0) @ vals
    return out


def make_problem(cases=CASES, block_size=4, contiguous=False, seed=0, dtype=torch.float32, device="cpu",
                 num_heads=4, num_kv_heads=2, head_dim=8, window=None, scale=None, softcap=None) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    need = [-(-(c + m) // block_size) for c, m, _ in cases]
    order = list(range(sum(need) + 3)) if contiguous else rng.permutation(sum(need) + 3).tolist()
    shape = (len(order), block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)  # garbage where unused
    specs, qs, ks, vs, refs = [], [], [], [], []
    for (c, m, parents), n in zip(cases, need, strict=True):
        table, order = order[:n], order[n:]
        if parents == "random tree":
            parents = tuple(int(rng.integers(-1, i)) for i in range(m))
        k = torch.randn(c + m, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(c + m, num_kv_heads, head_dim, generator=gen)
        q = torch.randn(m, num_heads, head_dim, generator=gen)
        k, v, q = (t.to(dtype).float() for t in (k, v, q))  # the reference sees the rounded values
        for pos in range(c):
            k_cache[table[pos // block_size], pos % block_size] = k[pos]
            v_cache[table[pos // block_size], pos % block_size] = v[pos]
        specs.append(SeqSpec(c, m, table, parents))
        qs.append(q), ks.append(k[c:]), vs.append(v[c:])
        refs.append(dense_attention(q, k, v, c, parents or tuple(range(-1, m - 1)), window, scale, softcap))
    on = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return Problem(specs, on(torch.cat(qs)), on(torch.cat(ks)), on(torch.cat(vs)), on(k_cache), on(v_cache), torch.cat(refs))


def reference_kernel(q, k_cache, v_cache, g, scale, softcap=None):
    """The varlen kernel contract (``engine.attention.varlen_metadata.Kernel``), one
    request and one row at a time in float64: flash-attn's documented semantics
    (bottom-right causal; a window of ``g.window_left`` keys before the row's own
    diagonal; soft-capped scores; a row with no visible key gives out 0, lse -inf)."""
    bs = k_cache.shape[1]
    k_flat, v_flat = k_cache.reshape(-1, *k_cache.shape[2:]).double(), v_cache.reshape(-1, *v_cache.shape[2:]).double()
    cu_q, cu_k = g.cu_seqlens_q.tolist(), g.cu_seqlens_k.tolist()
    table = g.block_table.tolist()
    num_heads, group = q.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[0], num_heads), float("-inf"), dtype=torch.float64)
    for r in range(len(cu_q) - 1):
        m, n = cu_q[r + 1] - cu_q[r], cu_k[r + 1] - cu_k[r]
        slots = [table[r][p // bs] * bs + p % bs for p in range(n)]
        for i in range(m):
            diagonal = n - m + i
            visible = slots[: max(0, diagonal + 1)] if g.causal else slots
            if g.window_left >= 0:
                visible = [sl for p, sl in enumerate(visible) if p >= diagonal - g.window_left]
            if not visible:
                continue
            row = cu_q[r] + i
            for h in range(num_heads):
                s = k_flat[visible, h // group] @ q[row, h].double() * scale
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                lse[row, h] = torch.logsumexp(s, 0)
                out[row, h] = torch.softmax(s, 0) @ v_flat[visible, h // group]
    return out.to(q.dtype), lse.float()
