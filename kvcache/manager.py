"""Per-request block tables over a shared block pool, and the prefix cache.

A request's KV entries for token positions ``0 .. num_tokens-1`` live in the
slots ``block_table[pos // block_size] * block_size + pos % block_size``::

    block_size = 4, block_table = [7, 2]
    position:  0  1  2  3 | 4  5  6  7
    slot:     28 29 30 31 | 8  9 10 11

``allocate_slots`` grows a table to cover a number of tokens before a forward
pass writes them; ``truncate`` frees the blocks past a kept length (a drafter's
own cache rolls back with it; the target's tables keep their draft blocks, see
``Scheduler.update``); ``free`` releases everything. No torch here.

Prefix caching (``enable_prefix_caching``): after each step the scheduler
passes the request's verified length to ``cache_blocks``, which registers the
full blocks below it under their chain hash (``kvcache.block_hash``). At
admission ``find_cached_prefix`` returns the longest run of cached blocks
matching the request's tokens, and ``allocate_slots`` starts its table with
them (shared by reference count)::

    tokens (B = 4):  a b c d | e f g h | i j k
    cached:          [7]       [2]       -          -> table [7, 2, new], 8 tokens computed

A hit never includes the block holding the last token: the hit is capped to
the full blocks before position ``num_tokens - 1``, so that token (whose logits
give the next one) is computed into a private block. This makes shared blocks
read-only without copy-on-write: a shared block only covers positions below
the request's ``num_computed_tokens``, and every write (prompt chunk, decode
token, draft slot) lands at or above it. The cost is recomputing up to one
block when a whole prompt is cached (vLLM caps the same way).
"""

import itertools

import numpy as np

from kvcache.block_hash import extend_chain
from kvcache.block_pool import BlockPool

def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Owns the block tables of all live requests, keyed by request id."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[bytes]] = {}  # request id -> hash chain of its full committed blocks
        self._num_cached: dict[str, int] = {}  # request id -> leading blocks of its table registered

    @property
    def num_free_blocks(self) -> int:
        """Unreferenced blocks, cached ones included (they are evicted on demand)."""
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_tokens: int, cached: list[int] = ()) -> int:
        """Free blocks that ``allocate_slots(request_id, num_tokens, cached)`` would take:
        new ones, plus cached hits that are unreferenced now."""
        have = len(self._tables.get(request_id, ())) + len(cached)
        revived = sum(self.pool.ref_count(b) == 0 for b in cached)
        return max(0, blocks_needed(num_tokens, self.block_size) - have) + revived

    def allocate_slots(self, request_id: str, num_tokens: int, cached: list[int] = ()) -> bool:
        """Make the table cover positions ``0 .. num_tokens-1``; a new request's table
        starts with the ``cached`` blocks from ``find_cached_prefix``.

        Returns False, allocating nothing, when the pool has too few free blocks.
        """
        table = self._tables.get(request_id)
        if not cached and table is not None and blocks_needed(num_tokens, self.block_size) <= len(table):
            return True  # covered already (a decode step's usual case)
        if self.num_new_blocks(request_id, num_tokens, cached) > self.pool.num_free_blocks:
            return False
        if cached:
            if request_id in self._tables:
                raise RuntimeError(f"cached blocks for request {request_id} that already has a table")
            self.pool.touch(list(cached))  # before allocate: a touched block is no longer evictable
            self._num_cached[request_id] = len(cached)
        table = self._tables.setdefault(request_id, list(cached))
        need = blocks_needed(num_tokens, self.block_size) - len(table)
        if need > 0:
            table.extend(self.pool.allocate(need))
        return True

    def find_cached_prefix(self, request_id: str, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the longest prefix of full blocks of ``token_ids``,
        never the block of the last token (see the module docstring). Takes no
        reference: pass the result to ``allocate_slots``."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(token_ids) - 1) // self.block_size
        chain = extend_chain(self._hashes.setdefault(request_id, []), token_ids, max_blocks, self.block_size)
        hits = []
        for h in chain[:max_blocks]:
            block = self.pool.cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_blocks(self, request_id: str, token_ids: list[int], num_verified: int) -> None:
        """Register the full blocks of positions ``0 .. num_verified-1`` (committed tokens
        whose KV the target computed; never draft slots) in the prefix cache."""
        table = self._tables.get(request_id)
        if not self.enable_prefix_caching or not table:
            return
        full = min(num_verified // self.block_size, len(table))
        done = self._num_cached.get(request_id, 0)
        if full <= done:
            return
        chain = extend_chain(self._hashes.setdefault(request_id, []), token_ids, full, self.block_size)
        for i in range(done, full):
            self.pool.cache(table[i], chain[i])
        self._num_cached[request_id] = full

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Keep positions ``0 .. num_tokens-1``; free blocks past them. The freed blocks
        held only draft slots: never a cached or shared block (checked)."""
        table = self._tables.get(request_id)
        if table is None:
            return
        keep = blocks_needed(num_tokens, self.block_size)
        if keep < len(table):
            dropped = table[keep:]
            if keep < self._num_cached.get(request_id, 0) or any(self.pool.ref_count(b) != 1 for b in dropped):
                raise RuntimeError(f"rollback of request {request_id} to {num_tokens} tokens would free a shared block")
            self.pool.free(dropped)
            del table[keep:]

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (so its prefix is evicted last)."""
        self._hashes.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table[::-1])


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Slots of positions ``start .. end-1`` of one request. [end - start] int64."""
    pos = np.arange(start, end, dtype=np.int64)
    table = np.asarray(block_table, dtype=np.int64)
    return table[pos // block_size] * block_size + pos % block_size


def slot_mappings(block_tables: list[list[int]], num_tokens: np.ndarray, block_size: int) -> np.ndarray:
    """Slots of positions ``0 .. num_tokens[r]-1`` of each request ``r``, request after
    request: ``slot_mapping`` of every request at once. [sum(num_tokens)] int64."""
    table_lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=len(block_tables))
    if np.any(-(-num_tokens // block_size) > table_lens):
        raise IndexError("a block table is shorter than its request's positions")
    tables = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(table_lens.sum()))
    pos = np.arange(int(num_tokens.sum()), dtype=np.int64) - np.repeat(np.cumsum(num_tokens) - num_tokens, num_tokens)
    table_start = np.repeat(np.cumsum(table_lens) - table_lens, num_tokens)
    return tables[table_start + pos // block_size] * block_size + pos % block_size
