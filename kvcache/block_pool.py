"""The block pool: which KV-cache blocks are free, who holds the rest, and
which full blocks are cached for reuse by their content hash.

Pure bookkeeping over integer block ids; no tensors. A block is free when its
reference count is zero. A free block may still be *cached*: it keeps the hash
of the verified tokens it holds, and a later request with the same prefix
takes it back (``touch``) instead of recomputing it. Free blocks sit in one
least-recently-freed-first queue; ``allocate`` takes from its front and only
then drops a cached block's hash (eviction)::

    free queue (evicted first ->):   [3]  [7 h=a1]  [1 h=b2]  [5]
    allocate(2)  -> [3, 7]; the hash a1 leaves the cache with block 7
    touch([1])   -> block 1 leaves the queue with its hash b2 (a cache hit)

So ``num_free_blocks`` counts cached-but-unreferenced blocks as free: they are
reclaimed on demand, never leaked.
"""

from collections import OrderedDict


class BlockPool:
    """A fixed set of ``num_blocks`` block ids with ref counts, an LRU free
    queue and a map from block hash to cached block."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # front = evicted first
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # cached block -> its hash
        self._cached: dict[bytes, int] = {}  # hash -> cached block (the first one registered)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, least recently freed first, evicting their cached
        hashes; raises if fewer are free (callers check first)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self._uncache(b)
            self._ref_counts[b] = 1
        return blocks

    def touch(self, blocks: list[int]) -> None:
        """Take one more reference to each block, free (cached) or not."""
        for b in blocks:
            if self._ref_counts[b] == 0:
                if b not in self._hash_of:
                    raise RuntimeError(f"touch of free, uncached block {b}")
                del self._free[b]
            self._ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero join the back of
        the free queue (so pass a request's blocks tail first: its prefix, the
        part most likely shared, is then evicted last)."""
        for b in blocks:
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None

    # -- the prefix cache ----------------------------------------------------

    def cached_block(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def cache(self, block: int, block_hash: bytes) -> None:
        """Register a held, full block under ``block_hash``. When another block already
        holds that content, the first one stays the cached one and ``block`` stays private."""
        if self._ref_counts[block] <= 0:
            raise RuntimeError(f"caching free block {block}")
        if block_hash not in self._cached and block not in self._hash_of:
            self._cached[block_hash] = block
            self._hash_of[block] = block_hash

    def _uncache(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._cached[h]
