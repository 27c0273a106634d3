"""Static step buffers and padded buckets: a step's inputs at fixed addresses, in fixed shapes.

A step whose requests all feed the same number ``q`` of tokens as a chain (decodes: 1;
verification of ``k`` chain drafts: ``k + 1``) is padded to a bucket ``(requests, q)``,
``requests`` the next power of two. Its inputs and attention metadata are written into
buffers allocated once per bucket, so that every step of the bucket reads the same
tensors (what a captured CUDA graph needs, ``engine.cuda_graphs``)::

    bucket (4, 2), 3 real requests:
    request:      r0      r1      r2      pad
    ids:          a0 a1   b0 b1   c0 c1   0  0
    positions:    7  8    3  4    12 13   0  1
    slot_mapping: ...                     PAD_BLOCK * block_size + 0, + 1

Padding requests are neutral: each is a chain of ``q`` tokens with no context, on the
padding block (``PagedKV.pad_block``, past every block the KV manager hands out), so it
writes and reads only there; its rows are dropped. Each real row sees exactly what it
sees unpadded, and with the C kernels (batch invariant) its bits are the same.

Buffers per bucket (``R`` requests, ``Q`` tokens each, ``N = R * Q``, ``L`` keys at most):
ids, positions, slot_mapping [N] int64; block_table [R, L / block_size] int32;
cu_seqlens_q, cu_seqlens_k [R + 1] int32 (flash-attn's layout); for the ``cpu`` backend's
listed metadata start, length [N] and slots [R * L] int64 (request r's list at r * L).
"""

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import varlen_backend
from engine.attention.metadata import AttentionMetadata, ListedQueries, SeqSpec
from engine.attention.varlen_metadata import VarlenGroup, VarlenMetadata

REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# backend -> the varlen kernel of its bucketed metadata (the cpu backend's is listed, for the C kernel)
BUCKETED_BACKENDS = {"cpu": None, "torch_varlen": varlen_backend.torch_kernel, "flash_attn": varlen_backend.flash_kernel}


@dataclass(frozen=True)
class Bucket:
    requests: int  # padded number of requests
    tokens: int  # tokens fed per request (1: decode; k + 1: a chain of k drafts verified)

    @property
    def num_tokens(self) -> int:
        return self.requests * self.tokens


def make_buckets(max_requests: int, max_tokens: int) -> list[Bucket]:
    """Every (requests, tokens) bucket up to ``max_requests`` (rounded up to a power of two)
    and ``max_tokens`` per request, largest first (the order graphs are captured in)."""
    sizes = [n for n in REQUEST_BUCKETS if n < max_requests] + [next(n for n in REQUEST_BUCKETS if n >= max_requests)]
    return [Bucket(r, q) for r in reversed(sizes) for q in range(max_tokens, 0, -1)]


def bucket_for(specs: list[SeqSpec], buckets: list[Bucket]) -> Bucket | None:
    """The smallest bucket of ``specs`` (every request a chain of the same length with
    context), or None: the step runs eagerly, unpadded."""
    q = specs[0].query_len if specs else 0
    if not specs or any(s.query_len != q or s.parents is not None or s.context_len == 0 for s in specs):
        return None
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
        self.host = {"ids": i64(n), "positions": i64(n), "slot_mapping": i64(n), "block_table": i32(r, self.width),
                     "cu_seqlens_q": i32(r + 1), "cu_seqlens_k": i32(r + 1)}
        if backend not in BUCKETED_BACKENDS:
            raise ValueError(f"bucketed steps run on the {', '.join(BUCKETED_BACKENDS)} backends, not {backend}")
        self.listed = backend == "cpu"
        if self.listed:
            self.host.update(rows=np.arange(n, dtype=np.int64), start=np.zeros(n, np.int64),
                             length=np.zeros(n, np.int64), slots=np.zeros(r * self.max_len, np.int64))
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
        return VarlenMetadata(d["slot_mapping"], kernel, [group], [], None, block_size=self.block_size)

    def fill(self, specs: list[SeqSpec], input_ids: np.ndarray) -> None:
        """Writes the step (``specs`` chains of ``bucket.tokens``, flat ``input_ids``) and its
        padding into the buffers; the host arrays are copied once each, in place."""
        h, (r, q), bs = self.host, (self.bucket.requests, self.bucket.tokens), self.block_size
        ctx = np.zeros(r, np.int64)
        ctx[: len(specs)] = [s.context_len for s in specs]
        table = h["block_table"]
        table[:] = self.pad_block  # padding requests, and past each table's end: only the padding block
        for i, s in enumerate(specs):
            blocks = s.block_table[: self.width]
            table[i, : len(blocks)] = blocks
        h["ids"][:] = 0
        h["ids"][: len(input_ids)] = input_ids
        pos = ctx[:, None] + np.arange(q)  # [R, Q]
        h["positions"][:] = pos.reshape(-1)
        h["slot_mapping"][:] = _slots(table, pos, bs).reshape(-1)
        h["cu_seqlens_q"][:] = np.arange(r + 1) * q
        h["cu_seqlens_k"][1:] = np.cumsum(ctx + q)
        if self.listed:
            h["start"][:] = np.repeat(np.arange(r) * self.max_len, q)
            h["length"][:] = (pos + 1).reshape(-1)
            h["slots"][:] = _slots(table, np.broadcast_to(np.arange(self.max_len), (r, self.max_len)), bs).reshape(-1)
        self._copy()

    def _copy(self) -> None:
        if self.device.type == "cpu":
            return
        for k, a in self.host.items():
            self.dev[k].copy_(torch.from_numpy(a).pin_memory(), non_blocking=True)


def _slots(table: np.ndarray, pos: np.ndarray, block_size: int) -> np.ndarray:
    """[R, P] slots of positions ``pos`` [R, P] through block tables ``table`` [R, width]."""
    return np.take_along_axis(table, pos // block_size, 1).astype(np.int64) * block_size + pos % block_size
