"""A checking stand-in for ``flash_attn_2_cuda``, flash-attn 2.8.3's compiled module.

flash-attn's own Python interface (``tests.gpu_fake.flash_attn_sdist``) calls
``varlen_fwd`` here with fake CUDA tensors (``tests.gpu_fake.fake_cuda``). It raises,
with flash-attn's messages, where ``mha_varlen_fwd`` (csrc/flash_attn/flash_api.cpp)
raises: fp16/bf16 only and one dtype for q, k, v; int32 ``cu_seqlens`` (contiguous) and
``block_table`` (contiguous last dimension); every tensor on CUDA, and here on q's
device; q, k, v with a contiguous last dimension; paged blocks of a multiple of 256
tokens; head_dim a multiple of 8 and at most 256; query heads a multiple of the KV heads;
the shapes. It also refuses what the kernel would silently get wrong: a max_seqlen below
a real length (rows left uncomputed), block ids outside the cache. Then it computes the
kernel's contract on the CPU values (float32): bottom-right causal mask, windows,
softcap, and the kernel's edge behaviour: a row that sees no key gets out 0 and lse +inf.
Returns ``(out [total_q, H, D], softmax_lse [H, total_q] float32, p, rng_state)``.

``fwd_kvcache`` (``flash_attn_with_kvcache``) likewise follows ``mha_fwd_kvcache``: the
paged cache with new keys and values, int32 ``seqlens_k`` and ``block_table``, rotary
tables of q's dtype, contiguous, at least the cache's reach in rows, a rotary dim
divisible by 16. As one op (``flash_attn_standin::fwd_kvcache``, one kernel to the counts
and to CUDA graphs) it rotates the new keys (GPT-NeoX halves) and q at their positions
``seqlens_k + i``, writes the keys and values through ``block_table`` and attends.
"""

import torch

from tests.gpu_fake.fake_cuda import value

calls: list[dict] = []  # what each call got, for the tests: paged, causal, shapes


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _check_inputs(q, k, v, cu_q, cu_k, block_table, paged: bool) -> None:
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    _check(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _check(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k),
                    ("block_table", block_table)):
        if t is not None:
            _check(t.is_cuda, f"{name} must be on CUDA")
            _check(t.device == q.device, f"{name} is on {t.device}, q on {q.device} (one device per call)")
    if paged:
        _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
        _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    for t in (q, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(cu_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    _check(cu_k.is_contiguous(), "cu_seqlens_k must be contiguous")


def _check_shapes(q, k, v, cu_q, cu_k, block_table, paged: bool) -> None:
    batch, (_, heads, d) = cu_q.numel() - 1, q.shape
    heads_k = k.shape[2] if paged else k.shape[1]
    if paged:
        _check(k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
    _check(batch > 0, "batch size must be positive")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(d % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _check(heads % heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    kv_shape = (k.shape[0], k.shape[1], heads_k, d) if paged else (k.shape[0], heads_k, d)
    _check(k.shape == kv_shape and v.shape == kv_shape, f"k and v must have shape {kv_shape}")
    if paged:
        _check(block_table.dim() == 2 and block_table.shape[0] == batch,
               "block_table must have shape (batch_size, max_num_blocks_per_seq)")
    _check(cu_q.shape == (batch + 1,), "cu_seqlens_q must have shape (batch_size + 1)")
    _check(cu_k.shape == (batch + 1,), "cu_seqlens_k must have shape (batch_size + 1)")


def _check_values(q, k, cu_q, cu_k, tables, max_q: int, max_k: int, paged: bool) -> tuple[list[int], list[int]]:
    """(query lengths, key lengths); what the kernel would get silently wrong raises."""
    cq, ck = value(cu_q).tolist(), value(cu_k).tolist()
    q_lens = [b - a for a, b in zip(cq, cq[1:])]
    k_lens = [b - a for a, b in zip(ck, ck[1:])]
    _check(cq[0] == 0 and min(q_lens) >= 0 and cq[-1] == q.shape[0], f"cu_seqlens_q {cq} does not cover q's {q.shape[0]} rows")
    _check(max(q_lens) <= max_q, f"max_seqlen_q {max_q} < a query of {max(q_lens)}: its last rows would not be computed")
    _check(max(k_lens) <= max_k, f"max_seqlen_k {max_k} < a sequence of {max(k_lens)} keys")
    if paged:
        page, blocks = k.shape[1], value(tables)
        for b, n in enumerate(k_lens):
            used = blocks[b, : -(-n // page)]
            _check(used.numel() * page >= n, f"sequence {b}: {n} keys but block_table holds {blocks.shape[1]} blocks")
            _check(bool(((used >= 0) & (used < k.shape[0])).all()), f"sequence {b}: block ids outside the cache")
    else:
        _check(ck[0] == 0 and ck[-1] <= k.shape[0], f"cu_seqlens_k {ck} outside k's {k.shape[0]} rows")
    return q_lens, k_lens


def _keys(k, v, tables, cu_k, b: int, n: int, paged: bool):
    """Sequence b's n keys and values [n, heads_k, D] (CPU values)."""
    if not paged:
        start = int(value(cu_k)[b])
        return value(k)[start : start + n], value(v)[start : start + n]
    page = k.shape[1]
    pos = torch.arange(n)
    slots = value(tables)[b].long()[pos // page] * page + pos % page
    return value(k).flatten(0, 1)[slots], value(v).flatten(0, 1)[slots]


def _attend(q, keys, vals, scale: float, causal: bool, left: int, right: int, softcap: float):
    """q [m, H, D], keys/vals [n, Hk, D] -> (out [m, H, D] float32, lse [H, m]); bottom-right alignment."""
    m, n, group = q.shape[0], keys.shape[0], q.shape[1] // keys.shape[1]
    s = torch.einsum("mhd,nhd->hmn", q.float(), keys.float().repeat_interleave(group, 1)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(m)[:, None] + n - m, torch.arange(n)[None, :]  # row i's own position among the keys
    visible = torch.ones(m, n, dtype=torch.bool)
    if causal or right >= 0:
        visible &= j <= i + (0 if causal else right)
    if left >= 0:
        visible &= j >= i - left
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)  # [H, m]; -inf where no key
    probs = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hmn,nhd->mhd", probs, vals.float().repeat_interleave(group, 1))
    return out, lse.masked_fill(torch.isinf(lse), float("inf"))  # the kernel writes +inf for rows with no key


def varlen_fwd(q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
               max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
               window_size_left, window_size_right, softcap, return_softmax, gen):
    """``mha_varlen_fwd``'s checks and contract (see the module doc)."""
    paged = block_table is not None
    _check(q.is_cuda, f"Expected a CUDA device, got {q.device} (flash-attn's device guard)")
    _check(torch.cuda.get_device_capability(q.device)[0] >= 8, "FlashAttention only supports Ampere GPUs or newer.")
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, paged)
    _check_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, paged)
    _check(not return_softmax or p_dropout > 0, "return_softmax is only supported when p_dropout > 0.0")
    for name, given in (("out_", out_), ("seqused_k", seqused_k), ("leftpad_k", leftpad_k), ("alibi_slopes", alibi_slopes)):
        _check(given is None, f"the stand-in does not model {name}")
    _check(p_dropout == 0, "the stand-in does not model dropout")
    q_lens, k_lens = _check_values(q, k, cu_seqlens_q, cu_seqlens_k, block_table, max_seqlen_q, max_seqlen_k, paged)
    causal = is_causal and not (max_seqlen_q == 1)  # as the kernel: one query row sees every key either way
    left = -1 if window_size_left >= max_seqlen_k else window_size_left
    right = -1 if window_size_right >= max_seqlen_k else window_size_right
    calls.append(dict(paged=paged, causal=causal, q_lens=q_lens, k_lens=k_lens, dtype=q.dtype))
    outs, lses = [], []
    for b, (m, n) in enumerate(zip(q_lens, k_lens)):
        start = sum(q_lens[:b])
        keys, vals = _keys(k, v, block_table, cu_seqlens_k, b, n, paged)
        o, lse = _attend(value(q)[start : start + m], keys, vals, softmax_scale, causal, left, right, softcap)
        outs.append(o)
        lses.append(lse)
    mode = q.fake_mode
    out = mode.wrap(torch.cat(outs).to(q.dtype))
    lse = mode.wrap(torch.cat(lses, dim=1).contiguous())
    return out, lse, mode.wrap(torch.empty(0, dtype=q.dtype)), mode.wrap(torch.zeros(2, dtype=torch.int64))


@torch.library.custom_op("flash_attn_standin::fwd_kvcache", mutates_args=("k_cache", "v_cache"))
def _fwd_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cache_seqlens: torch.Tensor, rotary_cos: torch.Tensor | None, rotary_sin: torch.Tensor | None,
                 block_table: torch.Tensor, scale: float, causal: bool, left: int, right: int, softcap: float,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel (``mha_fwd_kvcache``'s): the new keys and values rotated and appended at
    ``cache_seqlens`` through ``block_table``, then q (rotated) over the cache; CPU values."""
    batch, m, heads, d = q.shape
    page, n = k_cache.shape[1], k.shape[1]
    outs, lses = [], []
    for b in range(batch):
        c = int(cache_seqlens[b])
        pos = torch.arange(c, c + n)
        _check(c + n <= block_table.shape[1] * page, f"sequence {b}: {c + n} keys past its block_table")
        slots = block_table[b].long()[pos // page] * page + pos % page
        _check(bool(((slots >= 0) & (slots < k_cache.shape[0] * page)).all()), f"sequence {b}: block ids outside the cache")
        k_new = k[b] if rotary_cos is None else _rotate(k[b], rotary_cos, rotary_sin, pos)
        k_cache.flatten(0, 1)[slots] = k_new
        v_cache.flatten(0, 1)[slots] = v[b]
        q_pos = pos[:m] if (causal or left >= 0 or right >= 0) else torch.full((m,), c)
        qb = q[b] if rotary_cos is None else _rotate(q[b], rotary_cos, rotary_sin, q_pos)
        keys = torch.arange(c + n)
        kslots = block_table[b].long()[keys // page] * page + keys % page
        o, lse = _attend(qb, k_cache.flatten(0, 1)[kslots], v_cache.flatten(0, 1)[kslots], scale, causal, left, right,
                         softcap)
        outs.append(o.to(q.dtype))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@_fwd_kvcache.register_fake
def _(q, k_cache, v_cache, k, v, cache_seqlens, rotary_cos, rotary_sin, block_table, scale, causal, left, right, softcap):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


def _rotate(x, cos, sin, pos):
    """x [n, heads, D] at positions pos [n]: GPT-NeoX halves over the first 2 * cos.shape[1] features,
    in float32, rounded to x's dtype (the kernel rotates as it loads, stores the cache's dtype)."""
    half = cos.shape[1]
    c, s = cos[pos].float()[:, None], sin[pos].float()[:, None]
    x0, x1, rest = x[..., :half].float(), x[..., half : 2 * half].float(), x[..., 2 * half :].float()
    return torch.cat([x0 * c - x1 * s, x0 * s + x1 * c, rest], -1).to(x.dtype)


def fwd_kvcache(q, kcache, vcache, k_, v_, seqlens_k_, rotary_cos_, rotary_sin_, cache_batch_idx_, leftpad_k_,
                block_table_, alibi_slopes_, out_, softmax_scale, is_causal, window_size_left, window_size_right,
                softcap, is_rotary_interleaved, num_splits):
    """``mha_fwd_kvcache``'s checks (the paged cache with new keys, as the decoder calls it)
    and contract; out [batch, seqlen_q, H, D], softmax_lse [batch, H, seqlen_q]."""
    _check(q.is_cuda, f"Expected a CUDA device, got {q.device} (flash-attn's device guard)")
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(kcache.dtype == q.dtype and vcache.dtype == q.dtype, "query and key must have the same dtype")
    for name, given in (("cache_batch_idx", cache_batch_idx_), ("leftpad_k", leftpad_k_), ("alibi_slopes", alibi_slopes_),
                        ("out_", out_)):
        _check(given is None, f"the stand-in does not model {name}")
    _check(block_table_ is not None and k_ is not None and v_ is not None and seqlens_k_ is not None,
           "the stand-in models the paged cache with new keys and seqlens_k")
    _check_kvcache_inputs(q, kcache, vcache, k_, v_, seqlens_k_, block_table_)
    if rotary_cos_ is not None:
        _check_rotary(q, rotary_cos_, rotary_sin_, block_table_.shape[1] * kcache.shape[1], is_rotary_interleaved)
    causal = is_causal and q.shape[1] > 1  # one query row sees every key either way
    seqlen_k = block_table_.shape[1] * kcache.shape[1]
    left = -1 if window_size_left >= seqlen_k else window_size_left
    right = 0 if causal else (-1 if window_size_right >= seqlen_k else window_size_right)
    calls.append(dict(kvcache=True, causal=causal, rotary=rotary_cos_ is not None, dtype=q.dtype))
    return torch.ops.flash_attn_standin.fwd_kvcache(q, kcache, vcache, k_, v_, seqlens_k_, rotary_cos_, rotary_sin_,
                                                    block_table_, softmax_scale, causal, left, right, softcap)


def _check_kvcache_inputs(q, kcache, vcache, k, v, seqlens_k, block_table) -> None:
    batch, m, heads, d = q.shape
    for name, t in (("q", q), ("k_cache", kcache), ("v_cache", vcache), ("k", k), ("v", v), ("seqlens_k", seqlens_k),
                    ("block_table", block_table)):
        _check(t.is_cuda and t.device == q.device, f"{name} must be on CUDA, on q's device")
    for t in (q, kcache, vcache, k, v):
        _check(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    _check(kcache.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    heads_k = kcache.shape[2]
    _check(heads % heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    _check(kcache.shape == vcache.shape == (kcache.shape[0], kcache.shape[1], heads_k, d), "k_cache and v_cache shapes")
    _check(block_table.dim() == 2 and block_table.shape[0] == batch,
           "block_table must have shape (batch_size, max_num_blocks_per_seq)")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "Key must have the same dtype as query")
    _check(k.shape == v.shape == (batch, k.shape[1], heads_k, d), "k and v must have shape (batch, seqlen_knew, heads_k, d)")
    _check(m <= block_table.shape[1] * kcache.shape[1], "If key is supplied, it must have seqlen <= the seqlen of the KV cache")
    _check(seqlens_k.dtype == torch.int32, "seqlens_k must have dtype int32")
    _check(seqlens_k.is_contiguous() and seqlens_k.shape == (batch,), "seqlens_k must be contiguous, of shape (batch_size)")


def _check_rotary(q, cos, sin, seqlen_k: int, interleaved: bool) -> None:
    _check(sin is not None, "If rotary cos is provided, rotary sin must also be provided")
    rotary_dim = cos.shape[1] * 2
    _check(rotary_dim <= q.shape[-1], "rotary_dim must be <= headdim")
    _check(rotary_dim % 16 == 0, "Only rotary dimensions divisible by 16 are currently supported")
    _check(cos.shape[0] >= seqlen_k, "cos/sin seqlen must be at least the seqlen of KV cache")
    for t in (cos, sin):
        _check(t.is_cuda and t.shape == cos.shape and t.is_contiguous(),
               "rotary cos/sin: CUDA, (seqlen_ro, rotary_dim / 2), contiguous")
        _check(t.dtype == q.dtype, "rotary_cos must have the same dtype as query")
    _check(not interleaved, "the stand-in models GPT-NeoX halves (rotary_interleaved=False)")
