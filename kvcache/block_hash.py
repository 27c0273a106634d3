"""Content hashes of full KV blocks: the keys of the prefix cache.

Block ``i`` of a token sequence is named by a chain over the blocks before it::

    h_0 = H(ROOT || tokens[0 : B])
    h_i = H(h_{i-1} || tokens[i*B : (i+1)*B])        B = block_size

so equal hashes mean equal whole prefixes, not just equal blocks. ``H`` is
BLAKE2b (32-byte digest) over the token ids as little-endian int64. Not
Python's ``hash(tuple)``: that is 64 bits with no collision resistance, and a
collision here silently serves another prompt's KV (vLLM moved to SHA-256 for
the same reason); BLAKE2b is in the standard library, stable across processes
and releases, and cheap beside a step (once per full block).
"""

import hashlib

import numpy as np

ROOT = b"specserve-prefix-cache-v1"


def hash_block(parent: bytes, token_ids) -> bytes:
    data = np.asarray(token_ids, dtype="<i8").tobytes()
    return hashlib.blake2b(parent + data, digest_size=32).digest()


def extend_chain(chain: list[bytes], token_ids, num_blocks: int, block_size: int) -> list[bytes]:
    """Appends to ``chain`` (the hashes of the first ``len(chain)`` blocks of
    ``token_ids``) until it has ``num_blocks`` entries; returns it."""
    for i in range(len(chain), num_blocks):
        chain.append(hash_block(chain[-1] if chain else ROOT, token_ids[i * block_size : (i + 1) * block_size]))
    return chain
