"""The model forward of bucketed steps on static buffers, replayed as CUDA graphs.

A step that fits a bucket (``engine.worker.step_buffers``: decodes, and verification of chains
of up to k drafts) runs the model on its bucket's static buffers; on CUDA, unless
``--enforce-eager``, that forward is captured once per bucket at start-up (largest first,
all graphs sharing one memory pool) and each step only fills the buffers and replays.
Every other step (prefill chunks longer than k + 1, trees, more requests than the
largest bucket) runs eagerly, unpadded. Never on the CPU: there is no launch cost to save.

The captured region must not sync with the host, copy host data, or take a
data-dependent shape: ``tests/gpu_fake/test_graphs_safety.py`` checks it on the CPU.
"""

import logging

import numpy as np
import torch

from engine.attention import SeqSpec
from engine.worker.step_buffers import BUCKETED_BACKENDS, Bucket, StepBuffers, bucket_for, make_buckets
from kvcache.tensors import PagedKV

log = logging.getLogger(__name__)


def capture_graph(fn, pool):
    """Captures ``fn()`` (its tensors' addresses fixed) as a CUDA graph in memory ``pool``;
    returns (graph, fn's output, which each ``graph.replay()`` rewrites). Run ``fn`` once
    eagerly before capturing it (``warm_up``): lazy initialisation, and Triton's compiling
    and autotuning per shape, cannot run inside a capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def warm_up(fn) -> None:
    """``fn()`` once on a side stream, as torch's docs ask before capturing."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)


class BucketedForward:
    """``forward`` of the buckets' steps: the model on static buffers, replayed where captured."""

    def __init__(self, model, backend: str, kv, max_len: int, device, max_requests: int, max_tokens: int,
                 graphs: bool):
        if kv.pad_block is None:
            raise ValueError("bucketed steps need the KV cache's padding block (PagedKV(pad_block=True))")
        self.model, self.kv, self.device = model, kv, torch.device(device)
        self.backend, self.max_len = backend, max_len
        tokens = min(max_tokens, kv.spec.block_size)
        self.buckets = make_buckets(max_requests, tokens)
        self.buffers: dict[Bucket, StepBuffers] = {}
        self.graphs: dict[Bucket, tuple] = {}  # bucket -> (graph, static output [N, hidden])
        self.use_graphs = graphs
        self.graph_bytes = 0  # what capture took from the device (``capture_all``)

    def bucket_for(self, specs: list[SeqSpec]) -> Bucket | None:
        return bucket_for(specs, self.buckets)

    def forward(self, bucket: Bucket, specs: list[SeqSpec], input_ids: np.ndarray) -> torch.Tensor:
        """Final hidden states [sum of query lengths, hidden] of the step's real rows
        (a view of the graph's output when replayed: use it before the next step)."""
        buf = self._buffers(bucket)
        buf.fill(specs, input_ids)
        captured = self.graphs.get(bucket)
        if captured is None:
            out = self._run(buf)
        else:
            captured[0].replay()
            out = captured[1]
        return out[: sum(s.query_len for s in specs)]

    def capture_all(self) -> None:
        """Captures every bucket's forward (start-up, after the KV cache is allocated)."""
        if not self.use_graphs:
            return
        before = torch.cuda.memory_allocated(self.device)
        pool = torch.cuda.graph_pool_handle()
        for bucket in self.buckets:
            self._buffers(bucket).fill([], np.zeros(0, np.int64))  # every request a padding one
        for bucket in self.buckets:  # each shape once eagerly: Triton compiles (and autotunes) per shape
            warm_up(lambda b=self.buffers[bucket]: self._run(b))
        for bucket in self.buckets:  # largest first: the smaller ones reuse its pool
            self.graphs[bucket] = capture_graph(lambda b=self.buffers[bucket]: self._run(b), pool)
        torch.cuda.synchronize(self.device)
        self.graph_bytes = torch.cuda.memory_allocated(self.device) - before
        log.info("CUDA graphs: %d buckets captured, %.1f MiB", len(self.graphs), self.graph_bytes / 2**20)

    def _buffers(self, bucket: Bucket) -> StepBuffers:
        if bucket not in self.buffers:
            self.buffers[bucket] = StepBuffers(bucket, self.max_len, self.kv.spec.block_size, self.kv.pad_block,
                                               self.device, self.backend)
        return self.buffers[bucket]

    def _run(self, buf: StepBuffers) -> torch.Tensor:
        return self.model(buf.dev["ids"], buf.dev["positions"], buf.meta, self.kv)  # [N, hidden]


def graphs_apply(config, model, backend: str, device: torch.device) -> bool:
    """Whether the engine replays bucketed steps from CUDA graphs: on CUDA, without
    ``--enforce-eager``, on a backend with bucketed metadata, one process (tensor-parallel
    workers run their own forwards), and a model with no sliding window (its windowed
    metadata is built per step)."""
    arch = getattr(model, "arch", None)
    return (device.type == "cuda" and not config.model.enforce_eager and backend in BUCKETED_BACKENDS
            and arch is not None and all(w is None for w in arch.windows) and config.parallel.tensor_parallel_size == 1)


def bucket_limits(config) -> tuple[int, int]:
    """(most requests, most tokens per request) of the buckets: ``max_num_seqs``, and one
    token more than the drafts a request may verify (1 without speculation)."""
    sc = config.speculative
    return config.scheduler.max_num_seqs, 1 + (sc.num_speculative_tokens if sc.method else 0)


@torch.inference_mode()
def graph_pool_bytes(model, backend: str, spec, max_len: int, device, max_requests: int, max_tokens: int) -> int:
    """The graphs' memory, for the memory profile before the KV cache exists: every bucket's
    buffers and the peak of the largest bucket's forward above what was held before them.
    The graphs share one pool that keeps that peak for the engine's life."""
    blocks = -(-max_len // spec.block_size)
    kv = PagedKV(spec, blocks, device, pad_block=True)  # scratch: stands for the real cache, budgeted apart
    forward = BucketedForward(model, backend, kv, max_len, device, max_requests, max_tokens, graphs=False)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    for bucket in forward.buckets[1:]:  # every bucket's buffers, the largest one's forward
        forward._buffers(bucket)
    forward.forward(forward.buckets[0], [], np.zeros(0, np.int64))
    torch.cuda.synchronize(device)
    used = torch.cuda.max_memory_allocated(device) - before
    del forward, kv
    torch.cuda.empty_cache()
    return used
