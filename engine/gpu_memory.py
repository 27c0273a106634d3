"""How many KV blocks the engine allocates.

CPU: ``CacheConfig.memory_bytes`` (``--kv-cache-memory-bytes``) of blocks.

CUDA: vLLM's ``--gpu-memory-utilization`` rule. The engine may use
``utilization * total`` bytes of the GPU; weights, activations and anything else
this process holds come first, and the KV cache gets the rest. What the rest is
comes from a profiling pass: one forward over ``max_num_batched_tokens`` tokens
(the largest step the scheduler makes) plus their logits, whose peak is read
back from the CUDA allocator.
"""

import logging

import torch

from engine.attention import AttentionBackend, SeqSpec
from kvcache.tensors import KVSpec, PagedKV

log = logging.getLogger(__name__)


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
            f"{total_bytes * utilization / 2**30:.1f} GiB, and the weights and the largest step already take "
            f"{used_bytes / 2**30:.1f} GiB; raise --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return budget // bytes_per_block


@torch.inference_mode()
def profile_used_bytes(model, backend: AttentionBackend, spec: KVSpec, num_tokens: int, device) -> int:
    """Peak bytes this process holds on ``device`` during a forward of ``num_tokens``
    tokens (one prefill in a scratch cache just large enough), with their logits."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    blocks = -(-num_tokens // spec.block_size)
    kv = PagedKV(spec, blocks, device)
    meta = backend.build_metadata([SeqSpec(0, num_tokens, list(range(blocks)))], spec.block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    model.compute_logits(model(ids, torch.arange(num_tokens, device=device), meta, kv))
    torch.cuda.synchronize(device)
    peak_torch = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = (total - free) - torch.cuda.memory_reserved(device)  # CUDA context, other libraries
    del kv, meta
    torch.cuda.empty_cache()
    return peak_torch + max(0, outside_torch)


def num_kv_blocks(config, spec: KVSpec, model, backend: AttentionBackend, device: torch.device, max_model_len: int) -> int:
    """The KV cache's size in blocks for ``config`` (an ``EngineConfig``)."""
    if config.cache.num_blocks:
        return config.cache.num_blocks
    if device.type != "cuda":
        return spec.num_blocks_for(config.cache.memory_bytes)
    num_tokens = min(config.scheduler.max_num_batched_tokens, max_model_len)
    used = profile_used_bytes(model, backend, spec, num_tokens, device)
    total = torch.cuda.mem_get_info(device)[1]
    blocks = gpu_kv_blocks(total, used, config.cache.gpu_memory_utilization, spec.bytes_per_block())
    log.info("GPU memory: %.2f GiB total, %.2f GiB used at the profiled peak, %d KV blocks (%.2f GiB) at utilization %.2f",
             total / 2**30, used / 2**30, blocks, blocks * spec.bytes_per_block() / 2**30,
             config.cache.gpu_memory_utilization)
    return blocks
