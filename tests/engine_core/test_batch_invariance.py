"""Batch invariance, on each CPU kernel path (docs/cpu.md): a request's prompt log-probabilities,
tokens and output log-probabilities do not depend on what else is in its steps: prefill
chunks cut at other places, decodes of other requests, the same context in a neighbour, steps
of several 64-row blocks (the matmuls' work items); with a float32 and with a bfloat16 KV cache
(``--kv-cache-dtype``); for every family with a quirk of its own (Gemma 2's soft caps, Gemma 3's
and Phi-3's sliding windows, Qwen2's biases, the mixtures of experts' routing).

- C kernels (this CPU's build; where this CPU has AVX-512, the AVX2 build and the AVX-512 build of
  the other CPU vendor too: its matmul streams and attention read ahead): bitwise.
- No kernels (``SPECSERVE_CPU_KERNELS=0``: oneDNN and SDPA): within ``TORCH_TOLERANCE``.
"""

import pytest
import torch
import transformers

from engine.layers import cpu_kernels
from engine.models.arch import MoESpec, llama_arch
from engine.models.decoder import LlamaForCausalLM
from engine.models.registry import arch_of
from engine.sampling_params import SamplingParams
from tests.engine_core.conftest import AVX512_BUILD, other_vendor_build
from tests.engine_core.engine_helpers import run
from tests.models.families import BY_NAME, COMMON, randomize

VOCAB = 512
TORCH_TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # the torch path's promise on log-probabilities (docs/cpu.md)
PROMPT_LENGTHS = [150, 41, 7, 1, 90, 23]  # a chunk past 64 tokens, decodes of one token


PATHS = ["c", "c-avx2", "c-other-vendor", "torch"]
SKIP_AVX2 = pytest.mark.skipif(not AVX512_BUILD, reason="this CPU's build is the AVX2 one")


def use_kernel_path(path: str, monkeypatch) -> None:
    """Makes the engines of the test use the C kernels of this CPU's build (``c``), of the AVX2
    build (``c-avx2``) or of the AVX-512 build of the other CPU vendor (``c-other-vendor``), or
    none (``torch``: torch ops)."""
    if path.startswith("c") and cpu_kernels.load() is None:
        pytest.skip("no C kernels on this machine")
    if path in ("c-avx2", "c-other-vendor"):
        lib = cpu_kernels.build(cpu_kernels.compiler(), cpu_kernels.FLAGS) if path == "c-avx2" else other_vendor_build()
        monkeypatch.setattr(cpu_kernels, "load", lambda: lib)
    if path == "torch":
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)


# What each family has of its own, at the test's shape (head size 64, 2 layers): the families'
# checkpoints of tests/models with their quirks (windows of 12 positions, Gemma's soft caps and
# norms, Qwen2's biases, Phi-3's longrope, Qwen2-MoE's shared expert).
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=256, rope_scaling=None)
CHANGES = {
    "gemma3": dict(layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=96,
                                      short_factor=[1.0 + 0.05 * i for i in range(32)],
                                      long_factor=[2.0 + 0.1 * i for i in range(32)])),
    "qwen2_moe": dict(moe_intermediate_size=64, shared_expert_intermediate_size=96),
}


def family_model(name: str) -> LlamaForCausalLM:
    """Family ``name`` of tests/models at the test's shape, built as the loader builds it."""
    family = BY_NAME[name]
    kw = {**COMMON, **family.overrides, **SHAPE, **CHANGES.get(name, {})}
    kw = {k: v for k, v in kw.items() if v is not None}
    config = getattr(transformers, family.config)(**kw)
    model = LlamaForCausalLM(config, arch=arch_of(config))
    randomize(model, seed=0, embed_std=1.0)
    return model.eval()


TINY = dict(vocab_size=VOCAB, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
FAMILIES = {
    "llama": lambda tiny_model: tiny_model(**TINY),
    "mixtral": lambda tiny_model: tiny_model(**TINY, arch=lambda c: llama_arch(
        c, moe=MoESpec(4, 2, 128, True), moe_layers=(True, True))),
    **{name: lambda _, name=name: family_model(name) for name in ("gemma2", "gemma3", "qwen2", "phi3", "qwen2_moe")},
}
EVERY_PATH = ("llama", "mixtral")  # the others run on this CPU's build in the default suite, the rest is slow


def cases():
    for family in FAMILIES:
        for path in PATHS:
            for kv in ("auto", "bfloat16"):
                marks = [SKIP_AVX2] if path in ("c-avx2", "c-other-vendor") else []
                if family not in EVERY_PATH and (path, kv) != ("c", "auto"):
                    marks.append(pytest.mark.slow)
                yield pytest.param(family, path, kv, marks=marks, id=f"{family}-{path}-{kv}")


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


BUDGETS = (37, 137)  # steps of up to 37 rows (chunks cut anywhere), and of up to 137 (3 row blocks of 64)


@pytest.mark.parametrize("family,kernel_path,kv_cache_dtype", list(cases()))
def test_a_request_gets_the_same_numbers_whatever_shares_its_steps(make_engine, tiny_model, monkeypatch, family,
                                                                  kernel_path, kv_cache_dtype):
    """Alone (a prefill of up to 150 rows), and beside the others in steps cut at two budgets."""
    use_kernel_path(kernel_path, monkeypatch)
    model = FAMILIES[family](tiny_model)
    model.prepack()  # laid out for the path's matmul, as the loader does
    assert (model.lm_head.kernel is not None) == kernel_path.startswith("c")
    prompts, params = requests()
    alone = [results(run(make_engine(model, max_num_batched_tokens=512, kv_cache_dtype=kv_cache_dtype), [p], sp,
                         prefix=f"a{i}"))[0] for i, (p, sp) in enumerate(zip(prompts, params))]
    for budget in BUDGETS:
        engine = make_engine(model, max_num_batched_tokens=budget, kv_cache_dtype=kv_cache_dtype)
        together = results(run(engine, prompts, params))
        same_context = [e[1] for e in together[-1][0]], [e[1] for e in together[1][0][:29]]
        for got, want in zip(together, alone, strict=True):
            assert got[1] == want[1]  # the tokens (the tiny model's logits are far from ties)
            if kernel_path == "torch":
                for part in (0, 2):
                    torch.testing.assert_close(torch.tensor(got[part]), torch.tensor(want[part]), **TORCH_TOLERANCE)
            else:
                assert got == want, f"budget {budget}"
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
