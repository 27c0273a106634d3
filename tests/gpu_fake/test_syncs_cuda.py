"""Host syncs and host-to-device copies per decode step on fake CUDA, counted, not timed:
one sync a step (the step's tokens reaching the host; one more for logprobs), and every
step input copied from pinned memory without blocking."""

import pytest

from engine.config import SpeculativeConfig
from engine.sampling_params import SamplingParams
from tests.gpu_fake.device_lint import DeviceLint
from tests.gpu_fake.engines import PROMPTS, cuda_engine, cuda_model
from tests.gpu_fake.fake_cuda import fake_cuda

CHAINS = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_cost=0.05)
TREES = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_cost=0.05, tree_width=2, max_tree_nodes=6)
SAMPLED = dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, presence_penalty=0.5, frequency_penalty=0.2,
               repetition_penalty=1.1, logit_bias={5: 1.0}, seed=3)


BRANCHING = [9, 1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]  # "1 2" went on three ways: prompt lookup grows trees here


def decode_counts(engine, gpu, params_list):
    """(syncs, blocking copies, async copies, steps) over the decode steps after the prefill."""
    for i, (p, params) in enumerate(zip(PROMPTS + [BRANCHING], params_list)):
        engine.add_request(f"r{i}", p, params)
    engine.step()  # the prompts
    gpu.counts.reset()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return gpu.counts.num_syncs, gpu.counts.h2d_blocking, gpu.counts.h2d_async, steps


def run_counted(speculative, params_list):
    with fake_cuda() as gpu:
        engine = cuda_engine(cuda_model(echo=True), speculative)
        with DeviceLint() as lint:  # the step path: no tensor made without saying where
            counts = decode_counts(engine, gpu, params_list)
    assert not lint.findings, lint.findings
    return counts


@pytest.mark.parametrize("speculative", [None, CHAINS, TREES], ids=["plain", "chains", "trees"])
def test_two_syncs_per_step_and_no_blocking_copies(speculative):
    """Greedy, sampled and penalized requests in one batch, each with logprobs: two syncs a
    step (the tokens, their logprobs), whatever the rule that verified (the tree rule's own
    count: ``test_samplers_cuda``)."""
    params = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1, **kw)
              for kw in (dict(temperature=0.0), SAMPLED, dict(temperature=1.0, seed=4))]
    syncs, blocking, copies, steps = run_counted(speculative, params)
    assert syncs == 2 * steps and blocking == 0 and copies > 0, (syncs, blocking, steps)


def test_greedy_fast_path_syncs_once():
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)] * 3
    syncs, blocking, _, steps = run_counted(TREES, params)
    assert syncs == steps and blocking == 0
