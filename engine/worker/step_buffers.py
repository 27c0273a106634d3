"""Static step buffers and padded buckets: a step's inputs at fixed addresses, in fixed shapes.

A step whose requests all feed chains of at most ``Q`` tokens (decodes: 1; verification
of up to ``k`` chain drafts: ``k + 1``) is padded to a bucket ``(R, Q)``, ``R`` the next
power of two at or above its number of requests: ``N = R * Q`` token rows. Its inputs and
attention metadata are written into buffers allocated once per bucket, so that every
step of the bucket reads the same tensors (what a captured CUDA graph needs,
``engine.worker.cuda_graphs``); request lengths are data (``cu_seqlens``), not shapes::

    bucket (2, 3), a decode and a chain of 2 drafts (4 tokens; 2 rows of padding):
    request:      r0   r1          pad
    ids:          a0   b0 b1 b2    0  0
    positions:    7    3  4  5     0  1
    slot_mapping: ...              PAD_BLOCK * block_size + 0, + 1

Padding requests are neutral: chains of at most ``Q`` tokens with no context, on the
padding block (``PagedKV.pad_block``, past every block the KV manager hands out), so they
write and read only there; their rows are dropped. Each real row sees exactly what it
sees unpadded, and with the C kernels (batch invariant) its bits are the same. There are
``2R`` request slots: the step's, the padding requests, then empty ones (no query, no key).

Buffers per bucket (``L`` keys at most per request): ids, positions, slot_mapping [N]
int64; block_table [2R, L / block_size] int32; cu_seqlens_q, cu_seqlens_k [2R + 1] int32
(flash-attn's layout); for ``flash_attn``'s decode buckets cache_seqlens [R] int32 (the
context lengths, ``KVCacheStep``); for the ``cpu`` backend's listed metadata start, length [N] and
slots [2R * L] int64 (request slot r's list at r * L).
"""

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import varlen_backend
from engine.attention.metadata import AttentionMetadata, ListedQueries, SeqSpec
from engine.attention.varlen_metadata import KVCacheStep, VarlenGroup, VarlenMetadata

REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# backend -> the varlen kernel of its bucketed metadata (the cpu backend's is listed, for the C kernel)
BUCKETED_BACKENDS = {"cpu": None, "torch_varlen": varlen_backend.torch_kernel, "flash_attn": varlen_backend.flash_kernel}


@dataclass(frozen=True)
class Bucket:
    requests: int  # padded number of requests
    tokens: int  # most tokens fed per request (1: decodes; k + 1: chains of up to k drafts verified)

    @property
    def num_tokens(self) -> int:
        return self.requests * self.tokens


def make_buckets(max_requests: int, max_tokens: int) -> list[Bucket]:
    """Every (requests, tokens) bucket up to ``max_requests`` (rounded up to a power of two)
    and ``max_tokens`` per request, largest first (the order graphs are captured in)."""
    sizes = [n for n in REQUEST_BUCKETS if n < max_requests] + [next(n for n in REQUEST_BUCKETS if n >= max_requests)]
    return [Bucket(r, q) for r in reversed(sizes) for q in range(max_tokens, 0, -1)]


def bucket_for(specs: list[SeqSpec], buckets: list[Bucket]) -> Bucket | None:
    """The smallest bucket of ``specs`` (chains, the longest of ``tokens`` tokens), or None:
    the step runs eagerly, unpadded (trees, long queries, too many requests)."""
    if not specs or any(s.parents is not None for s in specs):
        return None
    q = max(s.query_len for s in specs)
    fits = [b for b in buckets if b.tokens == q and b.requests >= len(specs)]
    return min(fits, key=lambda b: b.requests) if fits else None


class StepBuffers:
    """One bucket's buffers (see the module doc) and the metadata that points into them."""

    def __init__(self, bucket: Bucket, max_len: int, block_size: int, pad_block: int, device, backend: str):
        if bucket.tokens > block_size:
            raise ValueError(f"a bucket of {bucket.tokens} tokens per request does not fit a padding block of {block_size}")
        self.bucket, self.block_size, self.pad_block, self.device = bucket, block_size, pad_block, torch.device(device)
        r, n = bucket.requests, bucket.num_tokens
        self.width = -(-max_len // block_size)  # blocks per request
        self.max_len = self.width * block_size  # L
        i64, i32 = lambda *shape: np.zeros(shape, np.int64), lambda *shape: np.zeros(shape, np.int32)
        self.host = {"ids": i64(n), "positions": i64(n), "slot_mapping": i64(n), "block_table": i32(2 * r, self.width),
                     "cu_seqlens_q": i32(2 * r + 1), "cu_seqlens_k": i32(2 * r + 1)}
        if backend not in BUCKETED_BACKENDS:
            raise ValueError(f"bucketed steps run on the {', '.join(BUCKETED_BACKENDS)} backends, not {backend}")
        self.listed = backend == "cpu"
        if self.listed:
            self.host.update(rows=np.arange(n, dtype=np.int64), start=np.zeros(n, np.int64),
                             length=np.zeros(n, np.int64), slots=np.zeros(2 * r * self.max_len, np.int64))
        self.kvcache = backend == "flash_attn" and bucket.tokens == 1  # decodes: every request slot < R one token
        if self.kvcache:
            self.host["cache_seqlens"] = i32(r)
        self.dev = {k: self._alloc(a) for k, a in self.host.items()}
        self.meta = self._metadata(BUCKETED_BACKENDS[backend])

    def _alloc(self, a: np.ndarray) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.from_numpy(a)  # the host array is the buffer: no copy
        return torch.zeros(a.shape, dtype=torch.from_numpy(a).dtype, device=self.device)

    def _metadata(self, kernel):
        d, b = self.dev, self.bucket
        if self.listed:
            listed = ListedQueries(d["rows"], d["start"], d["length"], d["slots"])
            return AttentionMetadata(d["slot_mapping"], listed=listed, block_size=self.block_size)
        group = VarlenGroup(None, d["cu_seqlens_q"], d["cu_seqlens_k"], b.tokens, self.max_len, d["block_table"], True)
        meta = VarlenMetadata(d["slot_mapping"], kernel, [group], [], None, block_size=self.block_size)
        if self.kvcache:  # the step's and the padding requests, R of one token each
            meta.kvcache = KVCacheStep(d["cache_seqlens"], d["block_table"][: b.requests], 1)
        return meta

    def fill(self, specs: list[SeqSpec], input_ids: np.ndarray) -> None:
        """Writes the step (``specs``: chains of at most ``bucket.tokens``, flat ``input_ids``)
        and its padding into the buffers; the host arrays are copied once each, in place."""
        h, (r, q), bs = self.host, (self.bucket.requests, self.bucket.tokens), self.block_size
        n = len(specs)
        qlen, ctx = np.zeros(2 * r, np.int64), np.zeros(2 * r, np.int64)  # [2R]: the step's requests, then padding
        qlen[:n], ctx[:n] = [s.query_len for s in specs], [s.context_len for s in specs]
        left = r * q - int(qlen.sum())
        pads = -(-left // q)  # padding requests of q tokens, the last one of what is left
        qlen[n : n + pads] = q
        if left % q:
            qlen[n + pads - 1] = left % q
        table = h["block_table"]
        table[:] = self.pad_block  # padding requests, and past each table's end: only the padding block
        for i, s in enumerate(specs):
            blocks = s.block_table[: self.width]
            table[i, : len(blocks)] = blocks
        req = np.repeat(np.arange(2 * r), qlen)  # [N] request of each token
        pos = ctx[req] + np.arange(r * q) - (np.cumsum(qlen) - qlen)[req]  # [N]
        h["ids"][:] = 0
        h["ids"][: len(input_ids)] = input_ids
        h["positions"][:] = pos
        h["slot_mapping"][:] = table[req, pos // bs].astype(np.int64) * bs + pos % bs
        h["cu_seqlens_q"][1:] = np.cumsum(qlen)
        h["cu_seqlens_k"][1:] = np.cumsum(ctx + qlen)
        if self.kvcache:
            h["cache_seqlens"][:] = ctx[:r]
        if self.listed:
            h["start"][:] = req * self.max_len
            h["length"][:] = pos + 1
            h["slots"][:] = _slots(table, np.broadcast_to(np.arange(self.max_len), (2 * r, self.max_len)), bs).reshape(-1)
        self._copy()

    def _copy(self) -> None:
        if self.device.type == "cpu":
            return
        for k, a in self.host.items():
            self.dev[k].copy_(torch.from_numpy(a).pin_memory(), non_blocking=True)


def _slots(table: np.ndarray, pos: np.ndarray, block_size: int) -> np.ndarray:
    """[R, P] slots of positions ``pos`` [R, P] through block tables ``table`` [R, width]."""
    return np.take_along_axis(table, pos // block_size, 1).astype(np.int64) * block_size + pos % block_size
