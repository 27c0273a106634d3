"""The typed messages between rank 0 and the other tensor-parallel ranks.

Rank 0 sends each worker one message per model call over its pipe (pickled
plain data: numpy arrays, ``SeqSpec``s, numbers); the activations then meet in
the collectives inside the layers (``engine.parallel``). A worker answers only
at start-up (``Joining``, then ``Ready`` or ``LoadFailed``).
"""

from dataclasses import dataclass

import numpy as np

from engine.attention import SeqSpec


@dataclass(frozen=True)
class WorkerInit:
    """Everything a worker needs to join the group and load its shard."""

    rank: int
    world_size: int
    store_port: int  # rank 0's TCPStore on 127.0.0.1
    backend: str  # gloo | nccl
    model_path: str
    attention_backend: str  # rank 0's (engine.attention.backends): every rank attends the same way
    dtype: str  # torch dtype name, e.g. "float32"
    device: str  # this rank's device, e.g. "cpu" or "cuda:1"
    max_positions: int
    num_threads: int
    collective_timeout_s: float


@dataclass(frozen=True)
class AllocateKV:
    """Allocate this rank's KV-cache shard: ``num_blocks`` blocks of ``block_size`` tokens
    over its own KV heads (sent once, before the first step)."""

    num_blocks: int
    block_size: int


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


@dataclass(frozen=True)
class Joining:
    """Worker -> rank 0: imports done, joining the group now (rank 0 joins once all are here,
    so a slow start does not count against the group's timeout)."""

    rank: int


@dataclass(frozen=True)
class Ready:
    """Worker -> rank 0: the group is joined and the shard loaded."""

    rank: int


@dataclass(frozen=True)
class LoadFailed:
    """Worker -> rank 0: start-up failed."""

    rank: int
    error: str
