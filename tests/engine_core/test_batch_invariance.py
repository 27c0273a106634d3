"""Batch invariance, on each CPU kernel path (docs/cpu.md): a request's prompt log-probabilities,
tokens and output log-probabilities do not depend on what else is in its steps: prefill
chunks cut at other places, decodes of other requests, the same context in a neighbour;
with a float32 and with a bfloat16 KV cache (``--kv-cache-dtype``).

- C kernels (this CPU's build; where this CPU has AVX-512, the AVX2 build and the AVX-512 build of
  the other CPU vendor too: its matmul streams and attention read ahead): bitwise.
- No kernels (``SPECSERVE_CPU_KERNELS=0``: oneDNN and SDPA): within ``TORCH_TOLERANCE``.
"""

import pytest
import torch

from engine.layers import cpu_kernels
from engine.models.arch import MoESpec, llama_arch
from engine.sampling_params import SamplingParams
from tests.engine_core.conftest import AVX512_BUILD, other_vendor_build
from tests.engine_core.engine_helpers import run

VOCAB = 512
TORCH_TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # the torch path's promise on log-probabilities (docs/cpu.md)
PROMPT_LENGTHS = [150, 41, 7, 1, 90, 23]  # a chunk past 64 tokens, decodes of one token


ON_AVX512 = pytest.mark.skipif(not AVX512_BUILD, reason="this CPU's build is the AVX2 one")


@pytest.fixture(params=["c", pytest.param("c-avx2", marks=ON_AVX512), pytest.param("c-other-vendor", marks=ON_AVX512),
                        "torch"])
def kernel_path(request, monkeypatch):
    """Which kernels the engines of the test use: the C kernels of this CPU's build, of the AVX2
    build or of the AVX-512 build of the other CPU vendor, or none (torch ops)."""
    if request.param.startswith("c") and cpu_kernels.load() is None:
        pytest.skip("no C kernels on this machine")
    if request.param in ("c-avx2", "c-other-vendor"):
        lib = (cpu_kernels.build(cpu_kernels.compiler(), cpu_kernels.FLAGS) if request.param == "c-avx2"
               else other_vendor_build())
        monkeypatch.setattr(cpu_kernels, "load", lambda: lib)
    if request.param == "torch":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    return request.param


FAMILIES = {"llama": None, "mixtral": lambda c: llama_arch(c, moe=MoESpec(4, 2, 128, True), moe_layers=(True, True))}


@pytest.fixture(params=list(FAMILIES))
def model(request, tiny_model, kernel_path):
    """A tiny model (head size 64) laid out for the path's matmul, as the loader does: a Llama,
    and a mixture of experts (its tokens' experts grouped differently in each step)."""
    m = tiny_model(vocab_size=VOCAB, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                   arch=FAMILIES[request.param])
    m.prepack()
    assert (m.lm_head.kernel is not None) == kernel_path.startswith("c")
    return m


def requests() -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    prompts.append(prompts[1][:30])  # a neighbour sharing a context
    params = [SamplingParams(max_tokens=6, temperature=0.0 if i % 3 else 1.0, seed=i, logprobs=2, prompt_logprobs=2,
                             ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


def results(finished) -> list[tuple]:
    """Per request: prompt log-probabilities (with their top 2), tokens, output log-probabilities."""
    flat = lambda entries: [(e.token_id, e.logprob, *(x for t in e.top for x in t)) for e in entries]  # noqa: E731
    return [(flat(f.request.prompt_logprobs), f.token_ids, flat(f.request.logprobs)) for f in finished]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_a_request_gets_the_same_numbers_whatever_shares_its_steps(make_engine, model, kernel_path, kv_cache_dtype):
    prompts, params = requests()
    alone = [results(run(make_engine(model, max_num_batched_tokens=512, kv_cache_dtype=kv_cache_dtype), [p], sp,
                         prefix=f"a{i}"))[0] for i, (p, sp) in enumerate(zip(prompts, params))]
    # chunks cut anywhere, beside other decodes
    engine = make_engine(model, max_num_batched_tokens=37, kv_cache_dtype=kv_cache_dtype)
    together = results(run(engine, prompts, params))
    same_context = [e[1] for e in together[-1][0]], [e[1] for e in together[1][0][:29]]
    for got, want in zip(together, alone, strict=True):
        assert got[1] == want[1]  # the tokens (the tiny model's logits are far from ties)
        if kernel_path == "torch":
            for part in (0, 2):
                torch.testing.assert_close(torch.tensor(got[part]), torch.tensor(want[part]), **TORCH_TOLERANCE)
        else:
            assert got == want
    if kernel_path != "torch":
        assert same_context[0] == same_context[1]


@pytest.fixture
def fresh_load(monkeypatch):
    """``cpu_kernels.load`` re-read from the environment (its cache cleared before and after)."""
    cpu_kernels.load.cache_clear()
    yield cpu_kernels.load
    monkeypatch.undo()
    cpu_kernels.load.cache_clear()


def test_the_environment_variables_select_the_kernel_build(fresh_load, monkeypatch):
    """``SPECSERVE_CPU_KERNELS=0`` turns the kernels off; ``SPECSERVE_CPU_AVX512=0`` keeps the
    AVX2 build on an AVX-512 CPU."""
    monkeypatch.setenv("SPECSERVE_CPU_KERNELS", "0")
    assert fresh_load() is None
    monkeypatch.delenv("SPECSERVE_CPU_KERNELS")
    monkeypatch.setenv("SPECSERVE_CPU_AVX512", "0")
    fresh_load.cache_clear()
    if fresh_load() is not None:
        assert cpu_kernels.compile_flags() == cpu_kernels.FLAGS


def test_the_kernels_build_wherever_the_cpu_and_a_compiler_allow():
    """A build failure would turn the kernels off and skip their tests: fail loudly instead."""
    if not cpu_kernels._cpu_supports() or cpu_kernels.compiler() is None:
        pytest.skip("no AVX2/FMA CPU or no C compiler")
    assert cpu_kernels.build(cpu_kernels.compiler(), cpu_kernels.FLAGS).weight_panel() > 0
