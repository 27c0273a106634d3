"""The target model split over ``tensor_parallel_size`` processes, as rank 0 sees it.

Rank 0 (the server process) runs the scheduler, the drafters and the sampler as
at size 1; its runner holds a ``TensorParallelModel`` where it would hold the
model. Each ``forward`` / ``compute_logits`` first sends the call to the other
ranks as a typed message (``messages``), then runs rank 0's shard; the
collectives inside the layers (``engine.layers.parallel``) join the ranks' parts, so
every rank ends with the same hidden states and rank 0 with the full logits.
The ranks may span nodes (``ParallelConfig.nnodes``; the other nodes run
``specserve serve --headless``). Each rank holds its attention and KV heads (whole KV heads with their query
heads, split as evenly as they go: SmolLM2's 3 KV heads over 2 ranks are 2 and
1), its slice of the MLP, of the vocabulary-parallel embedding and head, and
its KV-cache shard. Layout per rank::

    rank 0 (server)                      rank r (worker)
    scheduler, drafters, sampler         -
    model shard r=0   KV heads 0..a-1    model shard r      KV heads of rank r
    KV cache shard 0                     KV cache shard r
"""

import logging
import os

import numpy as np
import torch

from engine.config import EngineConfig
from engine.distributed.executor import TPWorkers
from engine.distributed.group import backend_for
from engine.attention.backends import select_backend
from engine.distributed.messages import AllocateKV, ComputeLogits, ForwardStep, ReleaseKV, WorkerInit
from engine.worker.loader import load_config, load_model
from engine.models.decoder import head_dim_of

log = logging.getLogger(__name__)


class TensorParallelModel:
    """Rank 0's shard with the model's interface (``__call__`` / ``compute_logits``,
    ``config``, ``layers``, ``lm_head``, ``rotary``, ``parameters()``: those of rank 0's
    shard). The workers hold a shard of one KV cache: the one the first call passes,
    until ``release_kv`` (the memory profile's scratch cache is released so)."""

    def __init__(self, local, workers: TPWorkers):
        self.local, self.workers = local, workers
        self.config, self.layers, self.lm_head, self.rotary = local.config, local.layers, local.lm_head, local.rotary
        self.min_rows = local.min_rows
        self._kv = None

    def parameters(self):
        return self.local.parameters()

    def __call__(self, input_ids, positions, meta, kv_cache, num_layers=None):
        """input_ids [T], positions [T] -> final-normed hidden states [T, hidden] (whole on every rank)."""
        self._bind(kv_cache)
        self.workers.send(ForwardStep(_numpy(input_ids), _numpy(positions), meta.specs, num_layers))
        return self.workers.run(self.local, input_ids, positions, meta, kv_cache, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> logits [S, vocab] in float32, gathered on rank 0."""
        self.workers.send(ComputeLogits(_numpy(hidden.float())))
        return self.workers.run(self.local.compute_logits, hidden)

    def release_kv(self) -> None:
        """The workers drop their KV shard; the next call binds its cache anew."""
        if self._kv is not None:
            self.workers.send(ReleaseKV())
            self._kv = None

    def _bind(self, kv) -> None:
        if self._kv is None:
            self.workers.send(AllocateKV(kv.num_blocks, kv.spec.block_size, str(kv.spec.dtype).removeprefix("torch.")))
            self._kv = kv
        elif kv is not self._kv:
            raise ValueError("tensor-parallel ranks hold one KV cache (the engine's); a drafter needs its own model")


def load_target(path, config: EngineConfig, dtype: torch.dtype, device: torch.device, max_positions: int):
    """The target model: loaded whole at ``tensor_parallel_size`` 1; otherwise the
    workers are started, each loads its shard, and rank 0's shard comes back
    wrapped in a ``TensorParallelModel``."""
    parallel = config.parallel
    size = parallel.tensor_parallel_size
    if size == 1:
        return load_model(path, dtype, device, max_positions=max_positions, quantization=config.model.quantization)
    hf_config = load_config(path)
    check_parallel(hf_config, size, device, parallel.ranks_per_node)  # before any process starts
    attention = select_backend(config.model.attention_backend, device, dtype, head_dim_of(hf_config)).name
    init = WorkerInit(
        backend=backend_for(device.type), model_path=str(path), attention_backend=attention,
        dtype=str(dtype).removeprefix("torch."), device=str(device), max_positions=max_positions,
        num_threads=config.model.num_threads, collective_timeout_s=parallel.collective_timeout_s,
        quantization=config.model.quantization,
    )
    workers = TPWorkers(init, parallel)
    try:
        local = load_model(path, dtype, device, workers.group, max_positions, config.model.quantization)
        workers.wait_ready()
    except BaseException:
        workers.shutdown()
        raise
    log.info("tensor parallelism: %d ranks on %d node(s) (%s), local worker pids %s", size, parallel.nnodes,
             init.backend, [w.process.pid for w in workers.workers])
    return TensorParallelModel(local, workers)


def check_parallel(hf_config, size: int, device: torch.device, ranks_per_node: int | None = None) -> None:
    """Raises ValueError, before any process starts, when the model cannot be split ``size`` ways
    (``ranks_per_node`` of them on this machine: all by default)."""
    ranks_per_node = ranks_per_node or size
    where = f"--tensor-parallel-size {size}"
    if hf_config.num_key_value_heads < size:
        raise ValueError(
            f"{where}: the model has {hf_config.num_key_value_heads} KV heads; every rank needs at least one, "
            f"so at most {hf_config.num_key_value_heads} ranks"
        )
    if hf_config.vocab_size % size:
        raise ValueError(f"{where}: the vocabulary ({hf_config.vocab_size} tokens) does not split evenly")
    first = device.index or 0
    if device.type == "cuda" and first + ranks_per_node > torch.cuda.device_count():
        raise ValueError(f"{where} from cuda:{first}: only {torch.cuda.device_count()} CUDA devices for the "
                         f"{ranks_per_node} ranks of this node (one rank per device, rank r on cuda:first+r)")
    if device.type == "cpu" and ranks_per_node > (os.cpu_count() or 1):
        log.warning("%s exceeds the %d CPU cores: the ranks will share cores", where, os.cpu_count())


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()
