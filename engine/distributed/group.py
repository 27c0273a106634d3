"""Building one tensor-parallel process group without touching torch.distributed's
process-wide default group: rank 0 hosts a ``TCPStore`` at ``master_addr:master_port``,
every rank (on any node) connects to it and constructs two group objects: the
tensor group (gloo on the CPU, NCCL on CUDA), which ``engine.layers.parallel.TPGroup``
calls directly, and a gloo control group that carries rank 0's messages
(``engine.distributed.channel``)."""

import os
import socket
from datetime import timedelta

import torch.distributed as dist

from engine.layers.parallel import TPGroup

LOOPBACK = "127.0.0.1"
CONTROL_PREFIX = "control"
IDLE_TIMEOUT = timedelta(days=365)  # a worker waits this long for rank 0's next message (an idle server)


def host_store(addr: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on ``port`` (0: a free one, ``store.port``)."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def join_store(addr: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def gloo_address(master_addr: str, master_port: int) -> str:
    """The address this node's gloo connections use: loopback when the group is on one
    machine, else the local address that routes to node 0 (``GLOO_SOCKET_IFNAME``, as
    torch reads it, chooses an interface instead)."""
    if master_addr in (LOOPBACK, "localhost"):
        return LOOPBACK
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, master_port or 1))  # UDP: picks the route, sends nothing
        return s.getsockname()[0]


def _gloo(store, rank: int, size: int, timeout: timedelta, address: str):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    device = dist.ProcessGroupGloo.create_device(interface=interface) if interface else \
        dist.ProcessGroupGloo.create_device(hostname=address)
    opts._devices = [device]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def make_group(store: dist.TCPStore, rank: int, size: int, backend: str, timeout_s: float, address: str) -> TPGroup:
    """Blocks until every rank has joined; collectives then fail after ``timeout_s``."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        group = _gloo(store, rank, size, timeout, address)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, opts)
    return TPGroup(rank, size, group)


def make_control_group(store: dist.TCPStore, rank: int, size: int, timeout_s: float, address: str):
    """The gloo group of rank 0's messages. Rank 0's sends fail after ``timeout_s``; the
    workers wait for the next message as long as the server stays idle."""
    timeout = timedelta(seconds=timeout_s) if rank == 0 else IDLE_TIMEOUT
    return _gloo(dist.PrefixStore(CONTROL_PREFIX, store), rank, size, timeout, address)
