"""The attention backends and the engine on CUDA (``gpu`` marker; skipped without a
CUDA device). NEVER RUN in this project yet: ``python -m bench.gpu_check`` runs them.

They need no conftest fixture (the device check may run them with ``--noconftest``)."""

import pytest
import torch

from engine.attention import paged_attention, select_backend
from engine.attention.backends import BACKENDS, flash_attn_installed
from bench.attention_problems import make_problem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")
BF16_TOL = 3e-2  # bf16 inputs and output (8 bits of mantissa); the reference is float64 of the same inputs


def backend_params():
    return [pytest.param("flash_attn", marks=pytest.mark.skipif(not flash_attn_installed(), reason="flash-attn not installed")),
            "torch_varlen", "torch"]


@pytest.mark.parametrize("name", backend_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_backend_matches_the_dense_reference(name, dtype):
    if name == "flash_attn" and dtype == torch.float32:
        pytest.skip("flash-attn has no float32")
    backend = BACKENDS[name]
    block = backend.block_size(16)
    pb = make_problem(block_size=block, dtype=dtype, device=CUDA, num_heads=8, num_kv_heads=2, head_dim=64)
    meta = backend.build_metadata(pb.specs, block, CUDA)
    out = paged_attention(pb.q, pb.k, pb.v, (pb.k_cache, pb.v_cache), meta)
    tol = 1e-4 if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.double().cpu(), pb.reference, atol=tol, rtol=tol)


def test_auto_picks_flash_attn_or_the_fallback():
    expected = "flash_attn" if flash_attn_installed() else "torch_varlen"
    assert select_backend("auto", CUDA, torch.bfloat16).name == expected
    assert select_backend("auto", CUDA, torch.float32).name == "torch_varlen"


def test_kv_cache_sized_by_gpu_memory_utilization():
    from bench.common import tiny_model
    from engine.attention.backends import TORCH_VARLEN
    from engine.worker.gpu_memory import ProfileShape, gpu_kv_blocks, profile_used_bytes
    from kvcache.tensors import KVSpec

    model = tiny_model(CUDA, torch.bfloat16)
    spec = KVSpec(2, 2, 32, 16, torch.bfloat16)
    used = profile_used_bytes(model, TORCH_VARLEN, spec, ProfileShape(256, 256, 4), CUDA)
    free, total = torch.cuda.mem_get_info(CUDA)
    assert 0 < used < total - free + (1 << 30)  # at least the weights, at most what is held plus the freed step
    blocks = gpu_kv_blocks(total, used, 0.5, spec.bytes_per_block())
    assert blocks * spec.bytes_per_block() <= 0.5 * total


@pytest.mark.parametrize("name", ["torch_varlen", "torch"])
def test_engine_greedy_is_the_same_with_every_backend(name):
    """float32 (bit-stable enough for greedy equality) on a tiny model: plain and ngram chains."""
    from types import SimpleNamespace

    from bench.common import repetitive_prompts, tiny_model
    from bench.gpu_check import engine_for, generate
    from engine.config import SpeculativeConfig

    args = SimpleNamespace(device=CUDA)
    model = tiny_model(CUDA, torch.float32)
    prompts = repetitive_prompts(6, 512)
    ref = generate(engine_for(model, args, "torch", torch.float32), prompts, 24)
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_cost=0.1)
    assert generate(engine_for(model, args, name, torch.float32, ngram), prompts, 24) == ref
    assert generate(engine_for(model, args, name, torch.float32), prompts, 24) == ref
