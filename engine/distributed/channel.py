"""Rank 0's typed messages to every other rank, on any node: each message is pickled
plain data (``engine.distributed.messages``) broadcast over the control group, its
length first, then its bytes. A broadcast is the one operation every rank already
has across nodes, it keeps the messages in order, and a rank that died breaks it at
once (its connections close) instead of leaving rank 0 waiting.

The start-up handshake, before the groups exist, goes through the store instead
(``Handshake``): each worker posts ``joined``, then ``ready`` or the traceback of
its failure, under its rank.
"""

import pickle

import torch
import torch.distributed as dist


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class Channel:
    """``send`` on rank 0, ``recv`` on the others (blocking until the next message)."""

    def __init__(self, group):
        self.group = group

    def send(self, msg) -> None:
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        _broadcast(self.group, torch.tensor([len(payload)], dtype=torch.int64))
        _broadcast(self.group, torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def recv(self):
        length = torch.zeros(1, dtype=torch.int64)
        _broadcast(self.group, length)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        _broadcast(self.group, payload)
        return pickle.loads(payload.numpy().tobytes())


class Handshake:
    """Start-up states of the workers, as store keys: ``joined/<rank>``, then
    ``ready/<rank>`` or ``failed/<rank>`` (a traceback); ``init``: the ``WorkerInit``
    rank 0 publishes; ``stop``: set by rank 0 when the group has failed."""

    def __init__(self, store):
        self.store = store

    def post(self, state: str, rank: int, text: str = "") -> None:
        self.store.set(f"{state}/{rank}", text)

    def has(self, state: str, rank: int) -> bool:
        return self.store.check([f"{state}/{rank}"])

    def read(self, state: str, rank: int) -> str:
        return self.store.get(f"{state}/{rank}").decode()

    def publish(self, key: str, value) -> None:
        self.store.set(key, pickle.dumps(value))

    def fetch(self, key: str):
        """The value published under ``key`` (waits for it up to the store's timeout)."""
        return pickle.loads(self.store.get(key))
