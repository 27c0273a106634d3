"""How many KV blocks the engine allocates.

CPU: ``CacheConfig.memory_bytes`` (``--kv-cache-memory-bytes``) of blocks.
Anywhere: ``CacheConfig.num_blocks`` (``--num-gpu-blocks-override``) when set.

CUDA: vLLM's ``--gpu-memory-utilization`` rule. The engine may use
``utilization * total`` bytes of the GPU; the weights, the drafter's weights, the
largest steps' activations and anything else this process holds come first, and
the KV caches (the target's and the drafter's, block for block) get the rest. The
activations come from a profiling pass over the largest steps the scheduler can
make (``ProfileShape``), at full context because attention's memory grows with it
(``torch_varlen`` gathers each request's keys and upcasts them): the last chunk of
the longest prompt, and every running request decoding with its drafts, with their
logits and the sampler's sort; their peak is read back from the CUDA allocator.
"""

import logging
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from engine.attention import AttentionBackend, SeqSpec
from engine.worker.sampler import build_sampling_batch, processed_probs
from engine.sampling_params import SamplingParams
from kvcache.tensors import KVSpec, PagedKV

log = logging.getLogger(__name__)

# The sampler's costliest settings: a sort of every row's vocabulary, then its cumulative sum.
_PROFILE_PARAMS = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01)


@dataclass(frozen=True)
class ProfileShape:
    """The largest steps the scheduler can make: the profile runs them."""

    max_model_len: int
    max_num_batched_tokens: int  # a step's tokens, drafts included
    max_num_seqs: int
    decode_tokens: int = 1  # a decoding request's tokens in a step: 1 + its drafts (tree nodes)

    @classmethod
    def of(cls, config, max_model_len: int) -> "ProfileShape":
        """From an ``EngineConfig``."""
        sc = config.speculative
        drafts = 0 if sc.method is None else sc.max_tree_nodes if sc.uses_trees else sc.num_speculative_tokens
        s = config.scheduler
        return cls(max_model_len, s.max_num_batched_tokens, s.max_num_seqs, 1 + drafts)

    def steps(self) -> list[list[tuple[int, int]]]:
        """Each profiled step's requests as (context_len, query_len): the last chunk of the
        longest prompt; then as many requests decoding at full context as the budget holds."""
        chunk = min(self.max_num_batched_tokens, self.max_model_len)
        q = min(self.decode_tokens, self.max_num_batched_tokens, self.max_model_len)
        n = max(1, min(self.max_num_seqs, self.max_num_batched_tokens // q))
        return [[(self.max_model_len - chunk, chunk)], [(self.max_model_len - q, q)] * n]


@dataclass(frozen=True)
class DrafterMemory:
    """What a drafter holds on the GPU beside the target: its weights, and KV bytes per
    block (its cache has as many blocks as the target's)."""

    weight_bytes: int = 0
    bytes_per_block: int = 0


def gpu_kv_blocks(total_bytes: int, used_bytes: int, utilization: float, bytes_per_block: int) -> int:
    """Blocks of ``bytes_per_block`` that fit in ``utilization * total_bytes`` once
    ``used_bytes`` (the profiled peak of everything else) are taken.

    >>> gpu_kv_blocks(total_bytes=100 << 30, used_bytes=20 << 30, utilization=0.9, bytes_per_block=1 << 20)
    71680
    """
    budget = int(total_bytes * utilization) - used_bytes
    if budget < bytes_per_block:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization} of {total_bytes / 2**30:.1f} GiB is "
            f"{total_bytes * utilization / 2**30:.1f} GiB, and the weights and the largest steps already take "
            f"{used_bytes / 2**30:.1f} GiB; raise --gpu-memory-utilization, or lower --max-num-batched-tokens, "
            "--max-num-seqs or --max-model-len"
        )
    return budget // bytes_per_block


@torch.inference_mode()
def profile_used_bytes(model, backend: AttentionBackend, spec: KVSpec, shape: ProfileShape, device) -> int:
    """Peak bytes this process holds on ``device`` while the model runs ``shape``'s steps,
    less the scratch KV cache they read (it stands for the real one, budgeted apart).
    Every request of a step reads the same scratch blocks: one full context's worth."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    blocks = -(-shape.max_model_len // spec.block_size)
    kv = PagedKV(spec, blocks, device)
    try:
        for step in shape.steps():
            _profile_step(model, backend, kv, step, device)
        torch.cuda.synchronize(device)
        peak_torch = torch.cuda.max_memory_allocated(device) - blocks * spec.bytes_per_block()
        free, total = torch.cuda.mem_get_info(device)
        outside_torch = (total - free) - torch.cuda.memory_reserved(device)  # CUDA context, other libraries
    finally:
        release = getattr(model, "release_kv", None)  # tensor-parallel workers drop their scratch too
        if release is not None:
            release()
        del kv
        torch.cuda.empty_cache()
    return peak_torch + max(0, outside_torch)


def _profile_step(model, backend: AttentionBackend, kv: PagedKV, requests: list[tuple[int, int]], device) -> None:
    """One step of ``requests`` (context_len, query_len), with logits at every row and the sampler."""
    table = list(range(kv.num_blocks))
    specs = [SeqSpec(c, q, table) for c, q in requests]
    meta = backend.build_metadata(specs, kv.spec.block_size, device)
    positions = np.concatenate([c + np.arange(q) for c, q in requests])
    ids = torch.zeros(len(positions), dtype=torch.long, device=device)
    logits = model.compute_logits(model(ids, torch.from_numpy(positions).to(device), meta, kv))  # [T, vocab]
    rows = [SimpleNamespace(params=_PROFILE_PARAMS)] * logits.shape[0]
    processed_probs(logits, build_sampling_batch(rows, logits.shape[-1], device, [None] * len(rows)))


def num_kv_blocks(config, spec: KVSpec, model, backend: AttentionBackend, device: torch.device, max_model_len: int,
                  drafter: DrafterMemory = DrafterMemory(), graph_bytes: int = 0) -> int:
    """The KV cache's size in blocks for ``config`` (an ``EngineConfig``); ``graph_bytes``: what
    the CUDA graphs will hold (``engine.worker.cuda_graphs.graph_pool_bytes``)."""
    if config.cache.num_blocks:
        return config.cache.num_blocks
    if device.type != "cuda":
        return spec.num_blocks_for(config.cache.memory_bytes)
    shape = ProfileShape.of(config, max_model_len)
    used = profile_used_bytes(model, backend, spec, shape, device) + drafter.weight_bytes + graph_bytes
    total = torch.cuda.mem_get_info(device)[1]
    per_block = spec.bytes_per_block() + drafter.bytes_per_block
    blocks = gpu_kv_blocks(total, used, config.cache.gpu_memory_utilization, per_block)
    log.info("GPU memory: %.2f GiB total, %.2f GiB used at the profiled peak (drafter weights %.2f GiB), %d KV blocks "
             "(%.2f GiB, drafter's included) at utilization %.2f; CUDA graphs %.2f GiB", total / 2**30, used / 2**30,
             drafter.weight_bytes / 2**30, blocks, blocks * per_block / 2**30, config.cache.gpu_memory_utilization,
             graph_bytes / 2**30)
    return blocks
