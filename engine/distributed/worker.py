"""A tensor-parallel worker: every rank but 0, each its own process, on node 0 (started
by rank 0) or on another node (started by ``specserve serve --headless``, ``headless``).

It joins the group at ``master_addr:master_port``, reads the ``WorkerInit`` rank 0
published, loads its shard of the model, and then runs whatever rank 0 sends:
``ForwardStep`` and ``ComputeLogits`` run its shard (the collectives inside the
layers meet rank 0's), ``AllocateKV`` builds its KV-cache shard, ``Shutdown`` ends
it. It never schedules or samples. It exits by itself when rank 0 is gone (the
control channel breaks, or the store does), when rank 0 declares the group failed
(the store's ``stop`` key), and when a collective fails (another rank died or hung:
the group's timeout).

A thread adds 1 to the store's ``beat/<rank>`` every ``HEARTBEAT_S``; rank 0's
watchdog declares the worker hung when the count stops moving (a stopped or wedged
process, on any node).
"""

import os
import signal
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from engine.attention.backends import BACKENDS
from engine.config import cpu_share
from engine.distributed.channel import Channel, Handshake
from engine.distributed.group import gloo_address, join_store, make_control_group, make_group
from engine.distributed.messages import (
    AllocateKV, ComputeLogits, ForwardStep, ReleaseKV, Rendezvous, Shutdown, WorkerInit,
)
from engine.worker.loader import load_model
from kvcache.tensors import KVSpec, PagedKV

HEARTBEAT_S = 0.5


def worker_main(rdv: Rendezvous, local_size: int) -> None:
    """The process's entry point (``multiprocessing`` spawn target); exits 1 on failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    store = join_store(rdv.master_addr, rdv.master_port, rdv.world_size, rdv.timeout_s)
    handshake = Handshake(store)
    init: WorkerInit = handshake.fetch("init")
    torch.set_num_threads(init.num_threads or cpu_share(local_size))
    threading.Thread(target=_beat, args=(rdv,), name="specserve-heartbeat", daemon=True).start()
    handshake.post("joined", rdv.rank)
    try:
        address = gloo_address(rdv.master_addr, rdv.master_port)
        tp = make_group(store, rdv.rank, rdv.world_size, init.backend, init.collective_timeout_s, address)
        channel = Channel(make_control_group(store, rdv.rank, rdv.world_size, init.collective_timeout_s, address))
        device = rank_device(init.device, rdv)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = load_model(Path(init.model_path), getattr(torch, init.dtype), device, tp, init.max_positions,
                           init.quantization)
    except Exception:  # noqa: BLE001 - reported to rank 0, which raises it at start-up
        handshake.post("failed", rdv.rank, traceback.format_exc())
        raise SystemExit(1) from None
    handshake.post("ready", rdv.rank)
    if not _serve(channel, model, device, BACKENDS[init.attention_backend].build_metadata):
        raise SystemExit(1)


def rank_device(rank0_device: str, rdv: Rendezvous) -> torch.device:
    """One GPU per rank, counting on node 0 from rank 0's (``--device cuda:N``: rank r on
    ``cuda:N+r``) and on the other nodes from ``cuda:0``; every CPU rank on the CPU."""
    if not rank0_device.startswith("cuda"):
        return torch.device("cpu")
    on_node_0 = rdv.rank == rdv.local_rank
    first = int(rank0_device.partition(":")[2] or 0) if on_node_0 else 0
    return torch.device(f"cuda:{first + rdv.local_rank}")


def _beat(rdv: Rendezvous) -> None:
    """Heartbeats through a store connection of its own; ends the process when rank 0
    failed the group or is gone."""
    try:
        store = join_store(rdv.master_addr, rdv.master_port, rdv.world_size, rdv.timeout_s)
        while not store.check(["stop"]):
            store.add(f"beat/{rdv.rank}", 1)
            time.sleep(HEARTBEAT_S)
    except Exception:  # noqa: BLE001 - the store went away with rank 0
        pass
    os._exit(1)


@torch.inference_mode()
def _serve(channel: Channel, model, device: torch.device, build_metadata) -> bool:
    """Runs rank 0's messages (``build_metadata``: rank 0's attention backend's); True
    after ``Shutdown``, False when the channel broke."""
    kv, block_size = None, 0
    dtype = next(model.parameters()).dtype
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    while True:
        try:
            msg = channel.recv()
        except Exception:  # noqa: BLE001 - rank 0 is gone
            return False
        match msg:
            case ForwardStep():
                meta = build_metadata(msg.specs, block_size, device)
                model(t(msg.input_ids), t(msg.positions), meta, kv, msg.num_layers)
            case ComputeLogits():
                model.compute_logits(t(msg.hidden).to(dtype))  # rank 0 keeps the gathered logits
            case AllocateKV():
                kv = None  # the old shard's memory goes before the new one's is taken
                spec = kv_spec(model, msg.block_size, getattr(torch, msg.dtype))
                kv, block_size = PagedKV(spec, msg.num_blocks, device), msg.block_size
            case ReleaseKV():
                kv = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            case Shutdown():
                return True
            case _:
                raise TypeError(f"unexpected message {type(msg).__name__}")


def kv_spec(model, block_size: int, dtype: torch.dtype) -> KVSpec:
    """The KV-cache layout of this rank's shard of ``model`` (its own KV heads), elements of ``dtype``."""
    attn = model.layers[0].self_attn
    return KVSpec(len(model.layers), attn.num_kv_heads, attn.head_dim, block_size, dtype)
