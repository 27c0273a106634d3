"""The engine with each attention backend that runs on the CPU: the same greedy
tokens as the torch reference backend, with and without draft chains; and the
KV-cache sizing rule of --gpu-memory-utilization."""

import dataclasses

import pytest
import torch

from engine.config import CacheConfig, SpeculativeConfig
from engine.worker.gpu_memory import gpu_kv_blocks
from engine.layers import cpu_kernels
from engine.llm_engine import LLMEngine
from tests.conftest import check_no_lost_blocks, engine_config
from tests.engine_core.engine_helpers import greedy, run

VOCAB = 512


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        motif = torch.randint(0, VOCAB, (4,), generator=g).tolist()
        out.append((motif * (2 + i))[: 5 + 7 * i])  # repeats: the ngram drafter finds drafts
    return out


def outputs(model, backend: str, speculative: SpeculativeConfig | None, block_size: int = 16):
    config = engine_config(max_model_len=256, num_blocks=64, block_size=block_size, speculative=speculative,
                           max_num_batched_tokens=48)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, attention_backend=backend))
    engine = LLMEngine(config, model=model)
    try:
        finished = run(engine, prompts(8), greedy(24))
        drafted = sum(f.deltas[-1].spec.get("num_draft_tokens", 0) for f in finished) if speculative else 0
        return [f.token_ids for f in finished], drafted, engine.runner.attention.name
    finally:
        check_no_lost_blocks(engine)


@pytest.mark.parametrize("backend", ["torch_varlen", pytest.param("cpu", marks=pytest.mark.skipif(
    cpu_kernels.load() is None, reason="no AVX2/FMA CPU or no C compiler"))])
@pytest.mark.parametrize("spec", [None, SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_cost=0.1)],
                         ids=["plain", "ngram-chains"])
def test_backend_gives_the_reference_tokens(tiny_model, spec, backend):
    model = tiny_model(vocab_size=VOCAB, seed=0)
    ref, _, name = outputs(model, "torch", spec)
    got, drafted, got_name = outputs(model, backend, spec)
    assert (name, got_name) == ("torch", backend)
    assert got == ref
    assert (drafted > 0) == (spec is not None)  # the chains case did verify drafts


def test_engine_refuses_flash_attn_on_the_cpu(tiny_model):
    config = engine_config(max_model_len=256, num_blocks=64)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, attention_backend="flash_attn"))
    with pytest.raises(ValueError, match="flash_attn needs a CUDA device"):
        LLMEngine(config, model=tiny_model(vocab_size=VOCAB))


def test_gpu_kv_blocks_rule():
    gib = 1 << 30
    # 80 GiB at 0.9 = 72 GiB; 20 GiB used leaves 52 GiB of 2 MiB blocks.
    assert gpu_kv_blocks(80 * gib, 20 * gib, 0.9, 2 << 20) == 52 * 512
    assert gpu_kv_blocks(80 * gib, 20 * gib, 0.5, 2 << 20) == 20 * 512
    with pytest.raises(ValueError, match="raise --gpu-memory-utilization"):
        gpu_kv_blocks(80 * gib, 73 * gib, 0.9, 2 << 20)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)
