"""``--kv-cache-dtype bfloat16``: keys and values stored in bfloat16 (rounded to nearest even at
the write), attention in float32 over them (docs/cpu.md).

- The C kernel over a bfloat16 cache gives the float32 kernel's bits over the same values
  widened to float32: the load is the only change.
- The torch backend and the C kernel read the same bfloat16 cache to within float32 rounding.
- Against a float32 cache of the unrounded values the output moves by the rounding of K and V
  (at most ``BF16_ATTENTION_TOLERANCE``); a tiny model's greedy tokens stay the same.
- The same KV budget holds twice the blocks; bad values and combinations fail at configuration.
"""

import dataclasses

import pytest
import torch

from engine.attention import SeqSpec, build_attention_metadata, paged_attention
from engine.attention.backends import select_backend
from engine.config import CacheConfig
from engine.layers import cpu_kernels
from engine.llm_engine import LLMEngine
from tests.conftest import engine_config
from tests.engine_core.engine_helpers import greedy, run

needs_kernel = pytest.mark.skipif(cpu_kernels.load() is None, reason="no AVX2/FMA CPU or no C compiler")

# Attention outputs (unit-variance values) over a bfloat16 cache against a float32 cache of the
# unrounded keys and values: each element is rounded by at most 2^-9 of itself.
BF16_ATTENTION_TOLERANCE = dict(rtol=2e-2, atol=2e-2)


def chain_problem(heads: int, kv_heads: int, head_dim: int, c: int, m: int, seed: int = 0):
    """A chain of m rows after c cached tokens, slots scattered over a float32 cache."""
    g = torch.Generator().manual_seed(seed)
    num_slots = c + m + 27
    k_cache, v_cache = (torch.randn(num_slots, kv_heads, head_dim, generator=g) for _ in range(2))
    q = torch.randn(m, heads, head_dim, generator=g)
    slots = torch.randperm(num_slots, generator=g)[: c + m]
    listed = (torch.arange(m), torch.zeros(m, dtype=torch.int64), torch.arange(c + 1, c + m + 1), slots)
    return q, k_cache, v_cache, listed


@needs_kernel
@pytest.mark.parametrize("c, m", [(37, 7), (150, 33), (0, 80)], ids=["in-registers", "key-blocks", "prefill"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 2, 128), (4, 2, 48), (3, 1, 36)])
def test_bf16_cache_gives_the_float32_kernels_bits_over_the_widened_values(kernel_build, heads, kv_heads, head_dim,
                                                                            c, m):
    q, k_cache, v_cache, listed = chain_problem(heads, kv_heads, head_dim, c, m)
    kb, vb = k_cache.bfloat16(), v_cache.bfloat16()
    out_bf16, out_widened, out_f32 = (torch.empty_like(q) for _ in range(3))
    cpu_kernels.paged_attention(q, kb, vb, *listed, out_bf16)
    cpu_kernels.paged_attention(q, kb.float(), vb.float(), *listed, out_widened)
    cpu_kernels.paged_attention(q, k_cache, v_cache, *listed, out_f32)
    assert torch.equal(out_bf16, out_widened)
    torch.testing.assert_close(out_bf16, out_f32, **BF16_ATTENTION_TOLERANCE)


@needs_kernel
def test_the_torch_backend_and_the_kernel_read_a_bf16_cache_alike(kernel_build):
    """Decodes, a chain, a tree and a fresh prefill, through the engine's two CPU backends: both
    round the new keys and values to bfloat16 and attend in float32 over the same cache."""
    g = torch.Generator().manual_seed(4)
    specs = [SeqSpec(23, 1, [3, 0]), SeqSpec(9, 5, [1, 4]), SeqSpec(6, 4, [2, 5], (-1, 0, 0, 1)), SeqSpec(0, 12, [6])]
    t = sum(s.query_len for s in specs)
    q, k, v = torch.randn(t, 4, 32, generator=g), torch.randn(t, 2, 32, generator=g), torch.randn(t, 2, 32, generator=g)
    cache = [torch.randn(8, 16, 2, 32, generator=g).bfloat16() for _ in range(2)]
    outs, written = [], []
    for listed in (True, False):
        kv = tuple(c.clone() for c in cache)
        outs.append(paged_attention(q, k, v, kv, build_attention_metadata(specs, 16, listed=listed)))
        written.append(kv)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(*written))
    slot = 0 * 16 + 23 - 16  # the decode's new key (position 23: its second block, 0), rounded as torch rounds
    assert torch.equal(written[0][0].view(-1, 2, 32)[slot], k[0].bfloat16())


@pytest.mark.parametrize("kernels", ["c", "torch"])
def test_a_tiny_model_writes_the_same_greedy_tokens_with_a_bf16_cache(make_engine, tiny_model, kernels, monkeypatch):
    """Prompts of 150, 41 and 7 tokens, 24 greedy tokens each; prompt log-probabilities within 1%."""
    if kernels == "c" and cpu_kernels.load() is None:
        pytest.skip("no C kernels on this machine")
    if kernels == "torch":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    model = tiny_model(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    model.prepack()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (150, 41, 7)]
    params = greedy(24, prompt_logprobs=0)
    got = {}
    for dtype in ("auto", "bfloat16"):
        engine = make_engine(model, max_num_batched_tokens=64, kv_cache_dtype=dtype)
        assert engine.paged_kv.k[0].dtype == (torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        got[dtype] = run(engine, prompts, params)
    for a, b in zip(got["auto"], got["bfloat16"]):
        assert a.token_ids == b.token_ids
        lp = [torch.tensor([e.logprob for e in f.request.prompt_logprobs[1:]]) for f in (a, b)]
        torch.testing.assert_close(lp[1], lp[0], rtol=1e-2, atol=1e-2)


def test_the_same_budget_holds_twice_the_blocks(tiny_model):
    model = tiny_model()
    blocks = {}
    for dtype in ("auto", "bfloat16"):
        config = engine_config(256, kv_cache_dtype=dtype)
        config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, num_blocks=None,
                                                                       memory_bytes=1 << 20))
        engine = LLMEngine(config, model=model)
        blocks[dtype] = engine.kv_manager.pool.num_blocks
        assert engine.paged_kv.spec.bytes_per_block() * blocks[dtype] == 1 << 20
    assert blocks["bfloat16"] == 2 * blocks["auto"]


def test_a_drafter_with_its_own_cache_allocates_it_in_the_cache_dtype(tiny_model):
    from drafters.draft_model import ModelDrafter

    model = tiny_model()
    drafter = ModelDrafter(model, 2, 8, 16, torch.bfloat16, torch.device("cpu"), 1.0)
    assert drafter.paged.k[0].dtype == drafter.paged.v[1].dtype == torch.bfloat16


def test_bad_values_and_combinations_fail_at_configuration():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16; got 'fp8'"):
        CacheConfig(kv_cache_dtype="fp8")
    assert CacheConfig(kv_cache_dtype="bfloat16").torch_kv_dtype(torch.float32) == torch.bfloat16
    assert CacheConfig().torch_kv_dtype(torch.float16) == torch.float16
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="flash_attn reads a KV cache of the model's dtype"):
        select_backend("flash_attn", cuda, torch.float16, 64, torch.bfloat16)
    assert select_backend("auto", cuda, torch.float16, 64, torch.bfloat16).name == "torch_varlen"
    if cpu_kernels.load() is not None:
        assert select_backend("cpu", torch.device("cpu"), torch.float32, 64, torch.bfloat16).name == "cpu"
        with pytest.raises(ValueError, match="cpu reads a float32 or bfloat16 KV cache"):
            select_backend("cpu", torch.device("cpu"), torch.float32, 64, torch.float16)
