"""The sampling and verification functions on fake CUDA, one by one: each must keep its
tensors on the logits' device and give what it gives on the CPU (the fake GPU computes
with the CPU's kernels, and a seeded fake CUDA generator draws what a CPU one does)."""

import pytest
import torch

from engine.worker.sampler import build_sampling_batch, compute_logprobs, processed_probs, sample
from engine.sampling_params import SamplingParams
from engine.spec_decode.metadata import build_verify_metadata
from engine.spec_decode.drafter import Draft
from engine.spec_decode.rejection_sampler import rejection_sample
from engine.spec_decode.tree_sampler import tree_verify
from engine.spec_decode.verify import verify
from tests.gpu_fake.fake_cuda import fake_cuda, value

V = 64


class Req:
    """What the sampler reads of a request."""

    def __init__(self, params: SamplingParams, tokens=(1, 2, 3, 2), num_prompt=2):
        self.params, self.token_ids, self.output_token_ids = params, list(tokens), list(tokens[num_prompt:])
        self.grammar = None


PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=5, seed=1),
    SamplingParams(temperature=1.2, top_p=0.7, min_p=0.05, presence_penalty=0.5, frequency_penalty=0.3,
                   repetition_penalty=1.3, logit_bias={3: 2.0, 9: -100.0}, seed=2),
    SamplingParams(temperature=1.0, logprobs=3),
]


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def on_both(fn, syncs: int = 0):
    """fn(device) on the CPU and on fake CUDA -> (cpu result, fake result's values); on CUDA
    ``fn`` may sync the host ``syncs`` times at most (its inputs built, its outputs unread)."""
    cpu = fn("cpu")
    with fake_cuda() as gpu:
        inputs = gpu.counts.num_syncs
        out = fn("cuda")
        assert gpu.counts.num_syncs - inputs <= syncs, gpu.counts
        flat = out if isinstance(out, tuple) else (out,)
        assert all(t.device.type == "cuda" for t in flat if isinstance(t, torch.Tensor))
        got = tuple(value(t) for t in flat) if isinstance(out, tuple) else value(out)
    return cpu, got


def test_sample_and_processed_probs():
    reqs = [Req(p) for p in PARAMS]

    def fn(device):
        gens = [None if p.seed is None else torch.Generator(device).manual_seed(p.seed) for p in PARAMS]
        batch = build_sampling_batch(reqs, V, device, gens)
        logits = logits_for(len(reqs)).to(device)
        return sample(logits, batch), processed_probs(logits, batch)

    (cpu_tokens, cpu_probs), (tokens, probs) = on_both(fn)
    assert tokens.tolist()[:3] == cpu_tokens.tolist()[:3]  # the greedy and the seeded rows
    torch.testing.assert_close(probs, cpu_probs)


def test_processed_probs_falls_back_to_the_argmax_where_nothing_is_left():
    logits = logits_for(2)
    logits[0] = -float("inf")  # no finite logit left in row 0
    params = SamplingParams(temperature=1.0)

    def fn(device):
        return processed_probs(logits.to(device), build_sampling_batch([Req(params)] * 2, V, device, [None] * 2))

    cpu, got = on_both(fn)
    torch.testing.assert_close(got, cpu)
    assert got[0].tolist() == [1.0] + [0.0] * (V - 1) and torch.isclose(got[1].sum(), torch.tensor(1.0))


@pytest.mark.parametrize("rank", [False, True])
def test_compute_logprobs(rank):
    tokens = [4, 17, 63]

    def fn(device):
        return compute_logprobs(logits_for(3).to(device), torch.tensor(tokens, device=device), 2, rank=rank)

    cpu = fn("cpu")
    with fake_cuda() as gpu:
        got = fn("cuda")
        assert gpu.counts.num_syncs == 1  # one copy to the host for all rows
    assert got == cpu and [lp.token_id for lp in got] == tokens


def verify_inputs(device, trees: bool):
    """Three requests: 2 chained drafts (q given), none, 3 drafts (a tree when ``trees``)."""
    g = torch.Generator().manual_seed(5)
    q = torch.softmax(torch.randn(2, V, generator=g), -1)
    parents = [None, None, (-1, -1, 0) if trees else None]
    meta = build_verify_metadata([[7, 8], [], [7, 9, 8]], parents, [q.to(device), None, None], V, device)
    logits = logits_for(meta.num_requests + 5, seed=6).to(device)  # R = 5 + 3 rows
    p = torch.softmax(logits, -1)
    uniforms = torch.rand(5, generator=g).to(device)
    noise = torch.empty(3, V).exponential_(generator=g).to(device)
    return meta, p, uniforms, noise


def test_rejection_sample():
    def fn(device):
        meta, p, uniforms, noise = verify_inputs(device, trees=False)
        return rejection_sample(p, meta, uniforms, noise)

    cpu, got = on_both(fn)
    for a, b in zip(cpu, got):
        assert torch.equal(a, b)


def test_tree_verify():
    def fn(device):
        meta, p, uniforms, noise = verify_inputs(device, trees=True)
        return tree_verify(meta, p, uniforms, noise)

    cpu, got = on_both(fn)
    for a, b in zip(cpu, got):
        assert torch.equal(a, b)


def test_verify_of_a_mixed_batch():
    """Greedy requests beside sampled ones: the sampled ones' rows are picked on the device, and
    the greedy rows' argmax and the sampled verdicts reach the host in one sync."""
    drafts = [Draft([7, 8]), None, Draft([7, 9, 8], None, (-1, -1, 0)), Draft([5])]

    def fn(device, gpu=None):
        g = torch.Generator().manual_seed(7)
        probs = torch.softmax(logits_for(10, seed=8), -1).to(device)  # [3 + 1 + 4 + 2 rows, V]
        uniforms, noise = torch.rand(6, generator=g).to(device), torch.empty(3, V).exponential_(generator=g).to(device)
        before = gpu.counts.num_syncs if gpu else 0
        verified = verify(drafts, [False, True, False, False], probs.argmax(-1), probs, uniforms, noise)
        assert gpu is None or gpu.counts.num_syncs - before == 1, gpu.counts
        return verified

    cpu = fn("cpu")
    with fake_cuda() as gpu:
        got = fn("cuda", gpu)
    assert got == cpu
