"""The runner on fake CUDA: every verification path (greedy chains, sampled chains,
trees) with logprobs, end to end through the engine."""

import pytest

from engine.config import SpeculativeConfig
from engine.sampling_params import SamplingParams
from tests.gpu_fake.engines import cuda_engine, cuda_model, run
from tests.gpu_fake.fake_cuda import fake_cuda

CHAINS = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_cost=0.05)
TREES = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_cost=0.05, tree_width=2, max_tree_nodes=6)


@pytest.mark.parametrize("speculative, temperature", [  # the default suite: sampled trees
    pytest.param(CHAINS, 0.0, id="greedy-chains", marks=pytest.mark.slow), pytest.param(TREES, 1.0, id="sampled-trees"),
    pytest.param(CHAINS, 1.0, id="sampled-chains", marks=pytest.mark.slow),
    pytest.param(TREES, 0.0, id="greedy-trees", marks=pytest.mark.slow),
])
def test_logprobs_under_speculation(speculative, temperature):
    """Each emitted token, accepted draft or not, has its logprob and top-2 from the row that
    predicted it; on CUDA the chosen tokens must reach the logits' device first."""
    with fake_cuda():
        engine = cuda_engine(cuda_model(echo=True), speculative)
        params = SamplingParams(max_tokens=8, temperature=temperature, seed=1, logprobs=2, ignore_eos=True)
        reqs, drafted = run(engine, [params, params])
        assert drafted > 0
        for r in reqs:
            assert r.finish_reason == "length" and len(r.output_token_ids) == 8
            assert [lp.token_id for lp in r.logprobs] == r.output_token_ids
            for lp in r.logprobs:
                assert lp.logprob <= 0 and len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]
                if temperature == 0.0:
                    assert lp.top[0][0] == lp.token_id


def test_prompt_logprobs_on_cuda():
    with fake_cuda():
        engine = cuda_engine(cuda_model())
        (req,), _ = run(engine, [SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)], [[3, 4, 5, 6, 7]])
        assert [lp.token_id for lp in req.prompt_logprobs] == [4, 5, 6, 7]


@pytest.mark.slow  # its paths run on fake CUDA in the default suite: test_model_cuda, the logprob and drafter tests
def test_the_device_checks_cuda_paths_on_fake_cuda():
    """bench.gpu_paths, the device check's section for these paths, runs on fake CUDA too."""
    from types import SimpleNamespace

    import torch

    from transformers import LlamaForCausalLM  # noqa: F401 - before fake CUDA: its module reads torch.cuda at import

    from bench.gpu_paths import cuda_paths

    with fake_cuda():
        report = cuda_paths(SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16))
    assert report.count("| ok |") == 3, report


def test_verification_is_timed_from_a_finished_forward(monkeypatch):
    """The runner books verification's time for the speculation policy: its clock starts
    after a synchronization, or the forward's queued kernels are booked as verification."""
    import time
    from types import SimpleNamespace

    import torch

    from engine.worker import runner as runner_module

    with fake_cuda() as gpu:
        engine = cuda_engine(cuda_model(echo=True), CHAINS)
        events = []
        real_clock = time.perf_counter
        clock = SimpleNamespace(perf_counter=lambda: events.append("clock") or real_clock())  # the runner's clock only
        monkeypatch.setattr(runner_module, "time", clock)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync") or gpu.synchronize(*a))
        _, drafted = run(engine, [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
        assert drafted > 0
        starts = [i for i, e in enumerate(events) if e == "clock"][::2]
        assert starts and all(i > 0 and events[i - 1] == "sync" for i in starts), events


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_a_cuda_engine_never_builds_the_cpu_kernels(monkeypatch, dtype):
    """The C kernels are for the CPU: a GPU server neither compiles nor loads them at start-up."""
    import torch

    from engine.layers import cpu_kernels, quant

    def refuse(*_):
        raise AssertionError("the CPU kernels were built on a CUDA engine")

    cpu_kernels.load.cache_clear(), quant.load.cache_clear()
    monkeypatch.setattr(cpu_kernels, "build", refuse)
    monkeypatch.setattr(quant, "build", refuse)
    try:
        with fake_cuda():
            model = cuda_model(getattr(torch, dtype))
            model.prepack()  # as the loader calls it
            engine = cuda_engine(model, CHAINS)
            (req,), _ = run(engine, [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)], [[5, 6, 7, 8] * 3])
            assert len(req.output_token_ids) == 4
    finally:
        monkeypatch.undo()
        cpu_kernels.load.cache_clear(), quant.load.cache_clear()
