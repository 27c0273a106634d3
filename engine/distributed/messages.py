"""The typed messages between rank 0 and the other tensor-parallel ranks.

Rank 0 sends every worker one message per model call through the control channel
(``channel.Channel``: pickled plain data, numpy arrays, ``SeqSpec``s, numbers); the
activations then meet in the collectives inside the layers (``engine.layers.parallel``).
Workers answer only at start-up, through the store (``channel.Handshake``).
"""

from dataclasses import dataclass

import numpy as np

from engine.attention import SeqSpec


@dataclass(frozen=True)
class Rendezvous:
    """Where and as what one worker process joins the group (its start arguments)."""

    rank: int
    local_rank: int  # its index among the ranks of its node (its GPU there)
    world_size: int
    master_addr: str
    master_port: int
    timeout_s: float  # the store's: how long a worker waits for rank 0 at start-up


@dataclass(frozen=True)
class WorkerInit:
    """What every worker needs to load its shard, published by rank 0 in the store."""

    backend: str  # gloo | nccl
    model_path: str  # the same path on every node
    attention_backend: str  # rank 0's (engine.attention.backends): every rank attends the same way
    dtype: str  # torch dtype name, e.g. "float32"
    device: str  # rank 0's, e.g. "cpu" or "cuda:2": node 0's rank r on cuda:2+r, other nodes' from cuda:0
    max_positions: int
    num_threads: int | None  # CPU threads per rank; None: each node shares out its own cores
    collective_timeout_s: float
    quantization: str = "auto"  # engine.worker.loader.load_model's


@dataclass(frozen=True)
class AllocateKV:
    """Allocate this rank's KV-cache shard: ``num_blocks`` blocks of ``block_size`` tokens
    over its own KV heads, elements of ``dtype`` (sent once, before the first step)."""

    num_blocks: int
    block_size: int
    dtype: str  # torch dtype name, e.g. "bfloat16" (rank 0's cache's: --kv-cache-dtype)


@dataclass(frozen=True)
class ReleaseKV:
    """Drop this rank's KV-cache shard (the memory profile's scratch cache; the engine's
    own comes with the next ``AllocateKV``)."""


@dataclass(frozen=True)
class ForwardStep:
    """Run the model over one flat batch; every rank builds the attention metadata from ``specs``."""

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    specs: list[SeqSpec]  # per request: context_len, query_len, block_table, tree parents
    num_layers: int | None  # None: every layer; k: the first k (the early-exit drafter)


@dataclass(frozen=True)
class ComputeLogits:
    """Project hidden states onto the vocabulary (each rank its vocabulary shard, then all-gather)."""

    hidden: np.ndarray  # [num_rows, hidden_size], rank 0's rows (identical on every rank)


@dataclass(frozen=True)
class Shutdown:
    """Leave the loop and exit."""
