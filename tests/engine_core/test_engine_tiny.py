"""The whole engine driven by tiny random-weight models: fast checks of
batching, preemption, chunking, EOS, logprobs and request validation."""

import pytest
import torch

from engine.sampling_params import InvalidParameter, SamplingParams
from tests.engine_core.engine_helpers import greedy, prompt_logits, run

VOCAB = 512


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(vocab_size=VOCAB, seed=0)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 90, (n,), generator=g).tolist()
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in lengths]


def test_tiny_model_logits_are_far_from_ties(model):
    """Guards the tests below: exact comparisons of greedy outputs need top-2
    margins far above float32 noise."""
    for p in prompts(10):
        logits = prompt_logits(model, p)
        top2 = logits.topk(2, -1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3


def test_batch_preemption_and_chunking_do_not_change_outputs(make_engine, model):
    """Greedy and seeded requests: alone, in one batch, and in a batch under a
    small pool and token budget (preemptions, chunked prefills) give the same
    tokens. A preempted seeded request keeps its generator's state."""
    ps = prompts(10)
    params = [
        greedy(20) if i % 2 else SamplingParams(max_tokens=20, temperature=4.0, seed=i, ignore_eos=True)
        for i in range(len(ps))
    ]
    alone = [run(make_engine(model), [p], sp)[0].token_ids for p, sp in zip(ps[:3], params[:3], strict=True)]
    reference = run(make_engine(model), ps, params)
    assert [r.token_ids for r in reference[:3]] == alone
    pressured = make_engine(model, num_blocks=8, block_size=16, max_model_len=128, max_num_batched_tokens=24)
    outs = run(pressured, ps, params)
    assert pressured.scheduler.num_preemptions > 0
    assert any(o.request.num_preemptions and o.request.params.seed is not None for o in outs)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    for o in outs:
        assert o.streamed_token_ids == o.token_ids  # each token streamed once, preempted or not
        assert o.finish_reason == "length"


def test_eos_of_the_model_config_stops_unless_ignored(tiny_model, make_engine):
    prompt = prompts(1, seed=3)[0]
    (free_run,) = run(make_engine(tiny_model(vocab_size=VOCAB)), [prompt], greedy(12))
    eos = free_run.token_ids[4]
    first = free_run.token_ids.index(eos)
    engine = make_engine(tiny_model(vocab_size=VOCAB, eos_token_id=eos))  # same seed: same weights
    stopped, ignored = run(engine, [prompt, prompt], [greedy(12, ignore_eos=False), greedy(12)])
    assert stopped.token_ids == free_run.token_ids[: first + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == free_run.token_ids and ignored.finish_reason == "length"


def test_logprobs_follow_the_model(make_engine, model):
    engine = make_engine(model)
    prompt = prompts(1, seed=4)[0]
    (out,) = run(engine, [prompt], greedy(3, logprobs=2))
    assert [lp.token_id for lp in out.request.logprobs] == out.token_ids
    logits = prompt_logits(model, prompt + out.token_ids)[len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits, -1)
    for lp, row in zip(out.request.logprobs, logp, strict=True):
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(2).indices.tolist()
    assert [lp for d in out.deltas for lp in d.logprobs] == out.request.logprobs


def test_request_validation(make_engine, model):
    engine = make_engine(model, max_model_len=64)
    for prompt, params, param in [
        ([], greedy(4), "prompt"),
        ([VOCAB], greedy(4), "prompt"),
        ([-1], greedy(4), "prompt"),
        ([1] * 60, greedy(5), "max_tokens"),
    ]:
        with pytest.raises(InvalidParameter) as info:
            engine.add_request("bad", prompt, params)
        assert info.value.param == param
    assert not engine.has_unfinished()
    engine.add_request("ok", [1] * 60, greedy(4))  # exactly max_model_len
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", [1, 2], greedy(4))
    while engine.has_unfinished():
        engine.step()


def test_engine_refuses_a_cache_smaller_than_max_model_len(make_engine, model):
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(model, max_model_len=128, num_blocks=7, block_size=16)


def test_unseeded_sampling_varies_and_seeded_repeats(make_engine, model):
    engine = make_engine(model)
    prompt = prompts(1, seed=5)[0]
    sampled = run(engine, [prompt] * 4, SamplingParams(max_tokens=8, temperature=8.0, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in sampled}) > 1
    seeded = run(engine, [prompt] * 3, SamplingParams(max_tokens=8, temperature=8.0, seed=11, ignore_eos=True))
    assert len({tuple(o.token_ids) for o in seeded}) == 1
