"""A tensor-parallel worker: ranks 1 .. N-1, each its own process.

It joins the group, loads its shard of the model, and then runs whatever rank
0 sends: ``ForwardStep`` and ``ComputeLogits`` run its shard (the collectives
inside the layers meet rank 0's), ``AllocateKV`` builds its KV-cache shard,
``Shutdown`` ends it. It never schedules or samples. It exits by itself when
rank 0's end of the pipe closes (rank 0 died), and when a collective fails
(another rank died or hung: the group's timeout).

A thread stamps ``heartbeat`` every ``HEARTBEAT_S``; rank 0's watchdog declares
the worker hung when the stamp grows old (a stopped or wedged process).
"""

import signal
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from engine.attention.backends import BACKENDS
from engine.distributed.group import join_store, make_group
from engine.distributed.messages import (
    AllocateKV, ComputeLogits, ForwardStep, Joining, LoadFailed, Ready, ReleaseKV, Shutdown, WorkerInit,
)
from engine.loader import load_model
from kvcache.tensors import KVSpec, PagedKV

HEARTBEAT_S = 0.5


def worker_main(init: WorkerInit, conn, heartbeat) -> None:
    """The process's entry point (``multiprocessing`` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 decides
    torch.set_num_threads(init.num_threads)
    threading.Thread(target=_beat, args=(heartbeat,), name="specserve-heartbeat", daemon=True).start()
    conn.send(Joining(init.rank))
    try:
        store = join_store(init.store_port, init.world_size, init.collective_timeout_s)
        tp = make_group(store, init.rank, init.world_size, init.backend, init.collective_timeout_s)
        device = torch.device(init.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        model = load_model(Path(init.model_path), getattr(torch, init.dtype), device, tp, init.max_positions)
    except Exception:  # noqa: BLE001 - reported to rank 0, which raises it at start-up
        conn.send(LoadFailed(init.rank, traceback.format_exc()))
        return
    conn.send(Ready(init.rank))
    _serve(conn, model, device, BACKENDS[init.attention_backend].build_metadata)


def _beat(heartbeat) -> None:
    while True:
        heartbeat.value = time.monotonic()
        time.sleep(HEARTBEAT_S)


@torch.inference_mode()
def _serve(conn, model, device: torch.device, build_metadata) -> None:
    """Runs rank 0's messages; ``build_metadata`` is rank 0's attention backend's."""
    kv, block_size = None, 0
    dtype = next(model.parameters()).dtype
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # rank 0 is gone
        match msg:
            case ForwardStep():
                meta = build_metadata(msg.specs, block_size, device)
                model(t(msg.input_ids), t(msg.positions), meta, kv, msg.num_layers)
            case ComputeLogits():
                model.compute_logits(t(msg.hidden).to(dtype))  # rank 0 keeps the gathered logits
            case AllocateKV():
                kv = None  # the old shard's memory goes before the new one's is taken
                kv, block_size = PagedKV(kv_spec(model, msg.block_size), msg.num_blocks, device), msg.block_size
            case ReleaseKV():
                kv = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            case Shutdown():
                return
            case _:
                raise TypeError(f"unexpected message {type(msg).__name__}")


def kv_spec(model, block_size: int) -> KVSpec:
    """The KV-cache layout of this rank's shard of ``model`` (its own KV heads)."""
    attn = model.layers[0].self_attn
    dtype = next(model.parameters()).dtype
    return KVSpec(len(model.layers), attn.num_kv_heads, attn.head_dim, block_size, dtype)
