"""The KV cache's size on fake CUDA: what the memory profile must cover, and that the
engine then stays within ``--gpu-memory-utilization``."""

import numpy as np
import pytest
import torch

from engine.attention import SeqSpec
from engine.attention.backends import BACKENDS
from engine.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from engine.worker.gpu_memory import ProfileShape, profile_used_bytes
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from kvcache.tensors import KVSpec, PagedKV
from tests.gpu_fake.engines import cuda_model
from tests.gpu_fake.fake_cuda import cuda_api, fake_cuda
from tests.parallel.checkpoints import save_random_llama

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return save_random_llama(root / "target"), save_random_llama(root / "draft", seed=1, num_hidden_layers=1)


def kv_spec(model, block_size=16) -> KVSpec:
    attn = model.layers[0].self_attn
    return KVSpec(len(model.layers), attn.num_kv_heads, attn.head_dim, block_size, next(model.parameters()).dtype)


@torch.inference_mode()
def decode_peak(gpu, model, backend, shape: ProfileShape, spec: KVSpec) -> int:
    """Bytes a decode step of ``max_num_seqs`` requests, each with its drafts at full
    context in its own blocks, allocates beyond the weights and the KV cache."""
    n, q = shape.max_num_seqs, shape.decode_tokens
    per_request = -(-shape.max_model_len // spec.block_size)
    kv = PagedKV(spec, n * per_request, CUDA)
    specs = [SeqSpec(shape.max_model_len - q, q, list(range(i * per_request, (i + 1) * per_request))) for i in range(n)]
    meta = backend.build_metadata(specs, spec.block_size, CUDA)
    ids = torch.zeros(n * q, dtype=torch.long, device=CUDA)
    pos = torch.tensor(np.concatenate([s.context_len + np.arange(q) for s in specs]), device=CUDA)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model.compute_logits(model(ids, pos, meta, kv)).softmax(-1)
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.parametrize("backend", ["torch_varlen", "torch"])
def test_profile_covers_the_worst_decode_step(backend):
    """At full context a decode step gathers every request's keys (torch_varlen upcasts
    them to float32): the profile must count that, not only one prefill without context."""
    shape = ProfileShape(max_model_len=2048, max_num_batched_tokens=128, max_num_seqs=16, decode_tokens=5)
    with fake_cuda() as gpu:
        model = cuda_model(max_position_embeddings=2048)
        spec = kv_spec(model)
        weights = torch.cuda.memory_allocated()
        used = profile_used_bytes(model, BACKENDS[backend], spec, shape, CUDA)
        worst = decode_peak(gpu, model, BACKENDS[backend], shape, spec)
        assert used - weights >= worst, (used - weights, worst)


def test_the_engine_stays_within_its_share_with_a_draft_model(checkpoints):
    """The draft model's weights and KV cache come out of the same budget as the target's."""
    target, draft = checkpoints
    with fake_cuda(total_bytes=64 << 20) as gpu:
        config = EngineConfig(
            ModelConfig(model=str(target), device="cuda", dtype="bfloat16", max_model_len=256,
                        attention_backend="torch_varlen"),
            CacheConfig(gpu_memory_utilization=0.5), SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
            SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=3, verify_cost=0.1),
        )
        engine = LLMEngine(config)
        engine.add_request("r", list(range(5, 40)), SamplingParams(max_tokens=4, temperature=0.0))
        while engine.has_unfinished():
            engine.step()
        assert gpu.peak <= 0.5 * gpu.total_bytes, (gpu.peak, gpu.total_bytes)
        assert engine.speculator.drafter.kv.pool.num_blocks == engine.kv_manager.pool.num_blocks


def test_num_gpu_blocks_override_skips_the_profile(monkeypatch):
    from engine.worker import gpu_memory
    from server.settings import ServerSettings

    settings = ServerSettings(num_gpu_blocks_override=37, device="cuda")
    assert settings.engine_config().cache.num_blocks == 37
    monkeypatch.setattr(gpu_memory, "profile_used_bytes", lambda *a: pytest.fail("profiled"))
    with fake_cuda():
        config = EngineConfig(ModelConfig(device="cuda", dtype="bfloat16", max_model_len=256),
                              settings.engine_config().cache)
        assert LLMEngine(config, model=cuda_model()).kv_manager.pool.num_blocks == 37


def test_tp2_profile_leaves_the_workers_on_the_engine_kv(checkpoints):
    """Profiling a tensor-parallel model runs the workers too, on a scratch cache of their
    own; the engine's cache must then be the one they use (gloo ranks on the CPU, the CUDA
    memory functions patched)."""
    from engine.distributed import load_target

    target, _ = checkpoints
    config = EngineConfig(ModelConfig(model=str(target), dtype="float32", device="cpu", num_threads=1),
                          parallel=ParallelConfig(tensor_parallel_size=2))
    model = load_target(target, config, torch.float32, torch.device("cpu"), 256)
    try:
        spec = kv_spec(model)
        with cuda_api():
            profile_used_bytes(model, BACKENDS["torch"], spec, ProfileShape(256, 32, 2, 1), torch.device("cpu"))
        kv = PagedKV(spec, 8, torch.device("cpu"))
        meta = BACKENDS["torch"].build_metadata([SeqSpec(0, 3, [0])], 16, "cpu")
        with torch.inference_mode():
            hidden = model(torch.tensor([1, 2, 3]), torch.arange(3), meta, kv)
        assert hidden.shape == (3, model.config.hidden_size)
    finally:
        model.workers.shutdown()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_eagle_memory_is_what_the_loaded_head_holds(tmp_path, kind):
    """The budget's estimate of a head (from its files) is what loading it takes on the GPU."""
    from drafters.eagle import memory_needs
    from drafters.eagle_head import load_eagle_head
    from tests.spec.eagle_heads import write_random_head

    from transformers import LlamaConfig

    from engine.models.decoder import LlamaForCausalLM
    from tests.gpu_fake.engines import TINY

    target = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    path = write_random_head(target, kind, tmp_path / kind, draft_vocab=64 if kind == "eagle3" else None)
    needs = memory_needs(SpeculativeConfig(method=kind, model=str(path)), dtype=torch.bfloat16, block_size=16)
    with fake_cuda() as gpu:
        target = target.to(device="cuda", dtype=torch.bfloat16)
        before = gpu.allocated
        head = load_eagle_head(path, kind, target, torch.bfloat16, CUDA, 256)
        held = gpu.allocated - before - sum(b.numel() * b.element_size() for b in head.buffers())
        assert needs.weight_bytes >= held >= 0.95 * needs.weight_bytes, (needs.weight_bytes, held)
        assert needs.bytes_per_block == 2 * 16 * head.num_kv_heads * head.head_dim * 2
