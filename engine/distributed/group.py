"""Building one tensor-parallel process group without touching torch.distributed's
process-wide default group: rank 0 hosts a ``TCPStore`` on 127.0.0.1, every rank
connects to it and constructs a gloo (CPU) or NCCL (CUDA) group object, which
``engine.parallel.TPGroup`` calls directly."""

from datetime import timedelta

import torch.distributed as dist

from engine.parallel import TPGroup

HOST = "127.0.0.1"


def host_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, on a free port (``store.port``)."""
    timeout = timedelta(seconds=timeout_s)
    return dist.TCPStore(HOST, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)


def join_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def backend_for(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def make_group(store: dist.TCPStore, rank: int, size: int, backend: str, timeout_s: float) -> TPGroup:
    """Blocks until every rank has joined; collectives then fail after ``timeout_s``."""
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
        group = dist.ProcessGroupGloo(store, rank, size, opts)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, opts)
    return TPGroup(rank, size, group)
