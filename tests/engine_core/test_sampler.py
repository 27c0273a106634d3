"""The sampler: processed distribution (penalties, bias, temperature, top-k,
top-p, min-p) against hand-computed values, and sampling frequencies against
the exact distribution, with proof that the frequency check catches a wrong
top-p."""

import math

import numpy as np
import pytest
import torch

import engine.worker.sampler as sampler
from engine.core.request import Request
from engine.worker.sampler import build_sampling_batch, compute_logprobs, penalized_logits, processed_probs, sample
from engine.sampling_params import InvalidParameter, SamplingParams
from tests.engine_core.engine_helpers import assert_distribution, chi_square_p_value, expected_probs


def make_requests(params: list[SamplingParams], prompt=(0, 1), output=()) -> list[Request]:
    reqs = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", list(prompt), p, frozenset())
        r.token_ids.extend(output)
        reqs.append(r)
    return reqs


def batch_for(params: list[SamplingParams], vocab: int, **kw):
    reqs = make_requests(params, **kw)
    return build_sampling_batch(reqs, vocab, "cpu", [None] * len(reqs))


# ---- hand-computed processing ----


def test_penalties_and_logit_bias_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]] * 2)
    penalized = SamplingParams(
        temperature=0.5,
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        logit_bias={4: 10.0, 0: -1.0},
    )
    plain = SamplingParams(temperature=0.5)
    # prompt [0, 1], output [3, 3, 2]: seen {0, 1, 2, 3}; output counts {3: 2, 2: 1}.
    b = batch_for([penalized, plain], 5, prompt=(0, 1), output=(3, 3, 2))
    out = penalized_logits(logits, b)
    expected = [
        2.0 / 2 - 1.0,  # repetition (positive: divided), bias -1
        -1.0 * 2,  # repetition (negative: multiplied); prompt tokens have no frequency/presence
        0.5 / 2 - 0.5 * 1 - 0.3,  # repetition, frequency x1, presence
        3.0 / 2 - 0.5 * 2 - 0.3,  # repetition, frequency x2, presence
        0.0 + 10.0,  # unseen, bias +10
    ]
    torch.testing.assert_close(out[0], torch.tensor(expected))
    torch.testing.assert_close(out[1], logits[1])  # the other row is untouched
    probs = processed_probs(logits, b)
    torch.testing.assert_close(probs[0], torch.softmax(torch.tensor(expected) / 0.5, -1))
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 0.5, -1))


def test_greedy_takes_argmax_after_penalties_and_bias_alongside_random_rows():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0),  # argmax: 1
        SamplingParams(temperature=0.0, logit_bias={3: 5.0}),  # 3
        SamplingParams(temperature=0.0, repetition_penalty=4.0),  # 1 seen: 3/4 < 2 -> 2
    ]
    b = batch_for(params, 4, prompt=(1,))
    assert sample(logits, b).tolist() == [1, 3, 2]
    # Mixed with a random row that can only pick token 0.
    params.append(SamplingParams(temperature=1.0, logit_bias={0: 100.0}))
    b = batch_for(params, 4, prompt=(1,))
    assert sample(torch.tensor([[1.0, 3.0, 2.0, 0.0]] * 4), b).tolist() == [1, 3, 2, 0]


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"top_k": 2}, [0.5, 0.3, 0, 0]),
        ({"top_p": 0.7}, [0.5, 0.3, 0, 0]),  # .5 < .7 <= .8: two tokens
        ({"top_p": 0.45}, [0.5, 0, 0, 0]),
        ({"top_p": 0.85}, [0.5, 0.3, 0.15, 0]),
        ({"min_p": 0.2}, [0.5, 0.3, 0.15, 0]),  # threshold .1
        ({"min_p": 0.7}, [0.5, 0, 0, 0]),  # threshold .35
        ({"top_k": 3, "top_p": 0.8}, [0.5, 0.3, 0, 0]),  # top-p over the renormalized top-3: .5/.95 < .8 <= .8/.95
        ({"top_k": 3, "top_p": 0.55}, [0.5, 0.3, 0, 0]),  # .5/.95 = .526 < .55
        ({"top_k": 1, "top_p": 0.1, "min_p": 0.9}, [1, 0, 0, 0]),  # never empty
    ],
)
def test_top_k_top_p_min_p_hand_computed(kw, expected):
    p = torch.tensor([0.3, 0.5, 0.05, 0.15])  # ranks: 1, 0, 3, 2
    b = batch_for([SamplingParams(**kw)], 4)
    got = processed_probs(p.log().unsqueeze(0), b)[0]
    want = torch.tensor(expected, dtype=torch.float32)[[1, 0, 3, 2]]
    torch.testing.assert_close(got, want / want.sum())


def test_temperature_scales_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    for t in (0.25, 1.0, 3.0):
        got = processed_probs(logits, batch_for([SamplingParams(temperature=t)], 3))
        torch.testing.assert_close(got[0], torch.softmax(logits[0] / t, -1))


def test_logprobs_are_of_the_raw_distribution():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    (lp,) = compute_logprobs(logits, torch.tensor([2]), top_n=2)
    raw = torch.log_softmax(logits[0], -1)
    assert lp.token_id == 2 and lp.logprob == pytest.approx(raw[2].item(), abs=1e-6)
    assert [t for t, _ in lp.top] == [1, 2]
    assert [v for _, v in lp.top] == pytest.approx([raw[1].item(), raw[2].item()], abs=1e-6)


# ---- sampling frequencies against the exact processed distribution ----

VOCAB = 200
SETTINGS = {  # rows of one batch; each group its own settings
    "top_k_top_p": (dict(temperature=0.8, top_p=0.9, top_k=50), 24_000),
    "min_p": (dict(temperature=1.3, min_p=0.2), 8_000),
    "plain": (dict(temperature=1.0), 8_000),
}


def fixed_logits() -> np.ndarray:
    """A head of 60 tokens with falling logits and a tail of 140 (an eighth of
    the mass at temperature 0.8), so that top-k changes where top-p cuts."""
    rng = np.random.default_rng(7)
    head = np.linspace(4.0, 1.0, 60) + rng.uniform(-0.1, 0.1, 60)
    tail = rng.uniform(0.2, 0.9, VOCAB - 60)
    logits = np.concatenate([head, tail])
    return logits[rng.permutation(VOCAB)]  # token ids unrelated to rank


def sample_groups(logits: np.ndarray, seed: int = 0) -> dict[str, np.ndarray]:
    params, names = [], []
    for name, (kw, n) in SETTINGS.items():
        params += [SamplingParams(**kw)] * n
        names += [name] * n
    reqs = [Request(f"r{i}", [0], p, frozenset()) for i, p in enumerate(params)]
    b = build_sampling_batch(reqs, VOCAB, "cpu", [None] * len(reqs))
    torch.manual_seed(seed)
    tokens = sample(torch.tensor(logits, dtype=torch.float32).expand(len(reqs), VOCAB), b).numpy()
    names = np.array(names)
    return {name: tokens[names == name] for name in SETTINGS}


def test_fixed_logits_are_shaped_as_intended():
    logits = fixed_logits()
    p = expected_probs(logits, temperature=0.8)
    top50 = np.sort(p)[::-1][:50].sum()
    assert 0.8 < top50 < 0.9  # so top-k renormalization moves the top-p cut
    with_k = expected_probs(logits, temperature=0.8, top_k=50, top_p=0.9)
    without_renorm = (np.cumsum(np.sort(p)[::-1]) < 0.9).sum() + 1
    assert 20 < (with_k > 0).sum() < 50 <= without_renorm


def test_sampling_frequencies_match_processed_distribution():
    logits = fixed_logits()
    samples = sample_groups(logits)
    for name, (kw, _n) in SETTINGS.items():
        probs = expected_probs(logits, **kw)
        assert (probs > 0).sum() < VOCAB or name == "plain"
        assert_distribution(samples[name], probs)


def wrong_top_p_one_token_too_many(logits, b):
    """top-p that keeps the first token past the cut as well."""
    logits = penalized_logits(logits, b) / b.temperature.unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1]).unsqueeze(0)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if b.top_k is not None:
        remove |= ranks >= b.top_k.unsqueeze(1)
    probs = sorted_logits.masked_fill(remove, -torch.inf).softmax(-1)
    if b.top_p is not None:
        past = (probs.cumsum(-1) - probs) >= b.top_p.unsqueeze(1)
        remove[:, 1:] |= past[:, :-1]  # one token later
    if b.min_p is not None:
        remove |= probs < b.min_p.unsqueeze(1) * probs[:, :1]
    return logits.scatter(1, order, sorted_logits.masked_fill(remove, -torch.inf))


def wrong_top_p_unrenormalized(logits, b):
    """top-p measured on the probabilities before top-k removed the tail."""
    logits = penalized_logits(logits, b) / b.temperature.unsqueeze(1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1]).unsqueeze(0)
    probs = sorted_logits.softmax(-1)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if b.top_k is not None:
        remove |= ranks >= b.top_k.unsqueeze(1)
    if b.top_p is not None:
        remove |= (probs.cumsum(-1) - probs) >= b.top_p.unsqueeze(1)
    if b.min_p is not None:
        remove |= probs < b.min_p.unsqueeze(1) * probs[:, :1]
    return logits.scatter(1, order, sorted_logits.masked_fill(remove, -torch.inf))


def wrong_unprocessed(logits, b):
    """The model's raw softmax: no temperature, no filtering."""
    return penalized_logits(logits, b)


def wrong_temperature_after_filtering(logits, b):
    """Filtering on temperature-1 probabilities, temperature applied afterwards."""
    t = b.temperature.unsqueeze(1)
    b1 = sampler.SamplingBatch(**{**b.__dict__, "temperature": torch.ones_like(b.temperature)})
    return ORIGINAL_PROCESSED_LOGITS(logits, b1) / t


def wrong_temperature_on_kept_tokens(logits, b):
    """The right support, but the kept tokens weighted at temperature 1: only
    the chi-square statistic (not the support check) can catch this one."""
    right = ORIGINAL_PROCESSED_LOGITS(logits, b)
    return torch.where(right.isinf(), right, penalized_logits(logits, b))


ORIGINAL_PROCESSED_LOGITS = sampler.processed_logits


@pytest.mark.parametrize(
    "wrong",
    [
        wrong_top_p_one_token_too_many,
        wrong_top_p_unrenormalized,
        wrong_unprocessed,
        wrong_temperature_after_filtering,
        wrong_temperature_on_kept_tokens,
    ],
)
def test_frequency_check_rejects_a_wrong_sampler(monkeypatch, wrong):
    """The frequency test has power: with a deliberately wrong processing the
    same samples-versus-exact-distribution check fails."""
    logits = fixed_logits()
    monkeypatch.setattr(sampler, "processed_logits", wrong)
    samples = sample_groups(logits)
    kw, _ = SETTINGS["top_k_top_p"]
    with pytest.raises(AssertionError):
        assert_distribution(samples["top_k_top_p"], expected_probs(logits, **kw))


def test_chi_square_check_merges_rare_tokens_and_flags_impossible_ones():
    probs = np.array([0.5, 0.3, 0.1999, 0.0001, 0.0])
    rng = np.random.default_rng(0)
    good = rng.choice(5, size=2000, p=probs)
    assert chi_square_p_value(good, probs) > 1e-3
    assert chi_square_p_value(np.append(good, 4), probs) == 0.0  # a token with p = 0
    skewed = rng.choice(5, size=2000, p=[0.43, 0.37, 0.1999, 0.0001, 0.0])
    assert chi_square_p_value(skewed, probs) < 1e-4


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch():
    logits = torch.tensor(fixed_logits(), dtype=torch.float32)
    params = SamplingParams(temperature=1.0, seed=5)

    def draw(n_rows: int, row: int, seed_global: int) -> int:
        reqs = [Request(f"r{i}", [0], params if i == row else SamplingParams(), frozenset()) for i in range(n_rows)]
        gens = [torch.Generator().manual_seed(5) if i == row else None for i in range(n_rows)]
        torch.manual_seed(seed_global)
        return sample(logits.expand(n_rows, VOCAB), build_sampling_batch(reqs, VOCAB, "cpu", gens))[row].item()

    first = [draw(1, 0, 0)] + [draw(n, n - 1, g) for n, g in ((3, 1), (8, 2))]
    assert len(set(first)) == 1
    # ...while unseeded rows do change with the global generator (the check above can fail).
    unseeded = {sample(logits.unsqueeze(0), batch_for([SamplingParams()], VOCAB)).item() for _ in range(20)}
    assert len(unseeded) > 1


@pytest.mark.parametrize("kw", [dict(temperature=0.7, top_p=0.9), dict(temperature=1.3, top_k=40),
                                dict(top_k=200, top_p=0.5, min_p=0.02), dict(temperature=0.5, min_p=0.1),
                                dict(top_p=0.999), dict(top_k=300)],
                         ids=["top-p", "top-k", "all-three", "min-p", "wide-top-p", "top-k-past-the-prefix"])
def test_a_vocabularys_best_tokens_ranked_first_give_the_full_sorts_distribution(kw, monkeypatch):
    """On the CPU the PREFIX best tokens are ranked first (topk); where every row's kept set
    lies among them the full sort is skipped, else it runs: the processed logits are the full
    sort's, token for token, either way (the last two cases keep more than PREFIX tokens)."""
    vocab, rows, prefix = 4096, 3, sampler.PREFIX
    g = torch.Generator().manual_seed(len(str(kw)))
    wide = kw in (dict(top_p=0.999), dict(top_k=300))
    logits = torch.randn(rows, vocab, generator=g) * torch.tensor([[4.0], [3.0], [0.2 if wide else 5.0]])
    b = batch_for([SamplingParams(**kw)] * rows, vocab)
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **k: sorts.append(1) or real_sort(self, *a, **k))
    with torch.no_grad():
        got = sampler.processed_logits(logits, b)
        monkeypatch.setattr(sampler, "PREFIX", vocab)  # the full sort only
        want = sampler.processed_logits(logits, b)
    assert torch.equal(got, want)
    assert len(sorts) == (2 if wide else 1)  # the reference's sort, and the prefix's fallback where it keeps more
    assert ((got > -torch.inf).sum(-1).max() > prefix) == wide


def test_a_row_with_no_finite_logit_left_is_one_hot_at_its_raw_argmax(monkeypatch):
    """Its p would be NaN (every token at -inf after processing): it becomes one-hot at the raw
    logits' argmax, and the other rows keep their p."""
    raw = torch.tensor([[0.5, 2.0, -1.0, 0.0], [1.0, 0.0, 3.0, 2.0]])
    b = batch_for([SamplingParams(temperature=0.7)] * 2, 4)
    good = processed_probs(raw, b)
    processed = sampler.processed_logits
    first_row = torch.tensor([[True], [False]])
    monkeypatch.setattr(sampler, "processed_logits", lambda x, batch: processed(x, batch).masked_fill(first_row, -torch.inf))
    mixed = processed_probs(raw, b)
    assert mixed[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert torch.equal(mixed[1], good[1]) and torch.allclose(good.sum(-1), torch.ones(2))


def test_a_batch_of_seeded_rows_leaves_the_shared_generator_alone():
    """Each seeded row draws its noise from its own generator; the shared one is not drawn
    from (a whole vocabulary of exponentials per row, otherwise drawn and thrown away)."""
    torch.manual_seed(3)
    state = torch.get_rng_state()
    noise = sampler.exponential_noise((2, 64), [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)], "cpu")
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(noise[1], torch.empty(64).exponential_(generator=torch.Generator().manual_seed(2)))
    sampler.exponential_noise((2, 64), [torch.Generator().manual_seed(1), None], "cpu")
    assert not torch.equal(torch.get_rng_state(), state)


# ---- SamplingParams validation ----


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.1}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"stop": ["ok", ""]}, "stop"),
    ],
)
def test_sampling_params_validation(kw, param):
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(**kw)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)


def test_sampling_params_normalization():
    p = SamplingParams(stop="END", stop_token_ids=[3, 4], top_k=-1, temperature=0.0)
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4) and p.top_k == 0
    assert p.greedy and not SamplingParams(temperature=0.01).greedy
    assert not SamplingParams().has_penalties and SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(stop=None).stop == ()
    assert math.isclose(SamplingParams(logit_bias={3: -100}).logit_bias[3], -100)
