"""Batches that mix what the unit tests keep apart, each request still emitting
exactly its own processed target distribution (chi-square of output[1..3]):

- drafts with probabilities (a sampling draft model) and without (prompt
  lookup: q one-hot at the drafted token) in the same verification;
- greedy and sampled requests with penalties, logit_bias, top-k, top-p and
  min-p side by side, with the adaptive policy choosing the draft lengths.

Each has a power check: the old layout that took a draft without
probabilities as q = 0, and a drafter that reports a q other than the one it
sampled from, are both caught."""

import numpy as np
import pytest
import torch

import engine.spec_decode.metadata
from engine.spec_decode.drafter import Drafter
from drafters import tree_drafting
from drafters.draft_model import ModelDrafter
from drafters.ngram import NgramDrafter
from engine import SamplingParams
from tests.spec.bigram import BigramLM, bigram_table, perturbed
from tests.spec.distribution import V, exact_joint, joint_counts, make_engine, p_value, run_groups

TARGET = bigram_table(V, seed=1)
DRAFT = perturbed(TARGET, seed=2)


def bigram_logits(context: list[int]) -> np.ndarray:
    return np.log(TARGET[context[-1]].double().numpy())


class MixedDrafter(Drafter):
    """Prompt lookup (drafts without probs) for the requests ``use_ngram`` picks, the
    bigram draft model (drafts with probs) for the others; both in every step."""

    deterministic = False
    cost_per_token = 0.05

    def __init__(self, use_ngram):
        self.ngram = NgramDrafter(1, 3)
        self.model = ModelDrafter(BigramLM(DRAFT), 1, 3000, 16, torch.float32, torch.device("cpu"), 0.05)
        self.use_ngram = use_ngram

    def _of(self, request_id: str) -> Drafter:
        return self.ngram if self.use_ngram(request_id) else self.model

    def context_class(self, request):
        return self._of(request.request_id).context_class(request)

    def propose(self, slots):
        out = {}
        for drafter in (self.ngram, self.model):
            mine = [s for s in slots if self._of(s.request.request_id) is drafter]
            if mine:
                out.update(drafter.propose(mine))
        return out

    def commit(self, request):
        self._of(request.request_id).commit(request)

    def free(self, request_id):
        self._of(request_id).free(request_id)


# ---- drafts with and without probabilities in one batch ----

T1 = dict(temperature=1.0)
PER_DRAFTER = 8000


def mixed_drafter_run():
    """Group 0 drafts by prompt lookup, group 1 by the draft model, in the same steps."""
    drafter = MixedDrafter(lambda rid: rid.startswith("g0-"))
    seen = {"with": 0, "without": 0}
    propose = drafter.propose

    def counted(slots):
        drafts = propose(slots)
        for d in drafts.values():
            seen["with" if d.probs is not None else "without"] += 1
        return drafts

    drafter.propose = counted
    params = SamplingParams(max_tokens=4, ignore_eos=True, **T1)
    outputs, spec = run_groups(make_engine(BigramLM(TARGET), drafter), [(params, PER_DRAFTER)] * 2)
    assert seen["with"] >= PER_DRAFTER and seen["without"] >= PER_DRAFTER
    assert spec.bonus[2] + spec.bonus[3] > PER_DRAFTER // 10, spec.bonus
    return [p_value(joint_counts(out), exact_joint(bigram_logits, T1)) for out in outputs]


def test_drafts_with_and_without_probs_verify_exactly_in_one_batch():
    assert min(mixed_drafter_run()) > 1e-3


def _deterministic_as_q_zero(flat_ids, probs, k, vocab_size, device):
    """The old layout: a draft without probs got q = 0, so it was accepted whenever p(x) > 0."""
    if not any(p is not None for p in probs):
        return None
    q = torch.zeros(len(flat_ids), vocab_size)
    for p, s, n in zip(probs, np.cumsum(k) - k, k):
        if p is not None:
            q[s : s + n] = p
    return q


@pytest.mark.slow  # a power check: the distribution test it backs runs in the default suite
def test_the_mixed_drafter_test_catches_q_zero_for_deterministic_drafts(monkeypatch):
    monkeypatch.setattr(engine.spec_decode.metadata, "_stack_probs", _deterministic_as_q_zero)
    prompt_lookup, draft_model = mixed_drafter_run()
    assert prompt_lookup < 1e-3  # the deterministic drafts are the ones verified wrongly
    assert draft_model > 1e-3


# ---- greedy and sampled requests, every kind of processing, adaptive draft lengths ----

PROCESSING = [
    dict(temperature=0.8, top_k=3),
    dict(temperature=1.0, min_p=0.15),
    dict(temperature=1.2, presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.4),
    dict(temperature=0.9, top_p=0.85, logit_bias={3: 1.0, 4: -2.0}),
    dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, logit_bias={4: -0.5}),
]
PER_SETTING = 4000


def processing_run():
    """One engine, adaptive, k up to 3; requests of every setting in every step, half of
    each setting drafted by prompt lookup and half by the draft model."""
    drafter = MixedDrafter(lambda rid: int(rid.rsplit("r", 1)[1]) % 2 == 0)
    engine_ = make_engine(BigramLM(TARGET), drafter, k=3, adaptive=True, verify_cost=0.05)
    groups = [(SamplingParams(max_tokens=4, ignore_eos=True, **s), PER_SETTING) for s in PROCESSING]
    outputs, spec = run_groups(engine_, groups)
    assert spec.drafted > len(PROCESSING) * PER_SETTING and 0.05 < spec.accepted / spec.drafted < 0.95
    assert spec.bonus[2] + spec.bonus[3] > PER_SETTING // 10, spec.bonus
    return [p_value(joint_counts(out), exact_joint(bigram_logits, s)) for out, s in zip(outputs, PROCESSING)]


def test_every_kind_of_processing_in_one_adaptive_batch_is_exact():
    p_values = processing_run()
    assert min(p_values) > 1e-3, dict(zip(map(str, PROCESSING), p_values))
    assert p_values[-1] == 1.0  # the greedy requests: all on the one path


_draw = tree_drafting.draw


def _report_unprocessed_q(q, logits, greedy, counts, noise):
    """A drafter that samples from its processed q but reports the penalized logits' softmax
    (no temperature, top-k or top-p) as the q of each draft."""
    drawn = _draw(q, logits, greedy, counts, noise)
    return [[(t, None if q_i is None else logits[r].softmax(-1)) for t, q_i in kids] for r, kids in enumerate(drawn)]


@pytest.mark.slow  # a power check: the distribution test it backs runs in the default suite
def test_the_processing_test_catches_a_q_other_than_the_one_sampled(monkeypatch):
    monkeypatch.setattr(tree_drafting, "draw", _report_unprocessed_q)
    p_values = processing_run()
    assert p_values[0] < 1e-3  # top-k: the reported q puts mass where the draft never samples
