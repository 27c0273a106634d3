"""Structured outputs stay exact under speculation: with a grammar, whole
speculative rounds through the real engine path emit exactly the target's
grammar-masked processed distribution (chi-square over many samples), and the
same test rejects a drafter whose q is not masked (then cutting its invalid
drafts biases the output) and a target whose p is not masked (the test has power).

The grammar is a ``choice`` grammar over one-character tokens, so the allowed
next tokens after any prefix are read off the list of choices, independently
of xgrammar.
"""

import json

import numpy as np
import pytest
import torch

import drafters.draft_model
import engine.worker.runner
from engine import SamplingParams
from engine.sampling_params import GuidedDecoding
from drafters.draft_model import ModelDrafter
from drafters.ngram import NgramDrafter
from tests.spec.bigram import BigramLM, bigram_table, perturbed
from tests.spec.distribution import METHOD_SETTINGS, SETTINGS, V, make_engine, p_value, processed
from tests.grammars import vocab_grammars

NUM_SAMPLES = 20_000
with torch.random.fork_rng():  # bigram_table draws from the global generator: pin it
    torch.manual_seed(0)
    TARGET = bigram_table(V, seed=1)
    DRAFT = perturbed(TARGET, seed=2)
CHARS = "abcdef"  # token i is the string CHARS[i]
CHOICES = ["abcd", "abde", "acef", "bdfa", "bdca", "beaf", "caeb", "dfab", "dfbc", "ecad", "fbda", "fbec", "fcea"]
# Some choices, then "a": prompt lookup finds drafts that the grammar allows, and others it cuts.
PROMPT = [CHARS.index(c) for c in "abcdbdfafbea"]


def allowed(prefix: tuple[int, ...]) -> np.ndarray:
    """The tokens some choice continues ``prefix`` with. [V] bool"""
    text = "".join(CHARS[t] for t in prefix)
    mask = np.zeros(V, dtype=bool)
    for c in CHOICES:
        if c.startswith(text) and len(c) > len(text):
            mask[CHARS.index(c[len(text)])] = True
    return mask


def exact_masked_joint(settings) -> np.ndarray:
    """P(output[1] = a, output[2] = b) for the bigram target under the grammar."""
    table = TARGET.double().numpy()

    def step(prev: int, prefix: tuple[int, ...]) -> np.ndarray:
        with np.errstate(divide="ignore"):  # log 0 = -inf: outside the grammar
            return processed(np.log(np.where(allowed(prefix), table[prev], 0.0)), settings)

    joint = np.zeros((V, V))
    first = step(PROMPT[-1], ())
    with np.errstate(divide="ignore"):
        for a0 in np.flatnonzero(first):
            second = step(a0, (a0,))
            for a1 in np.flatnonzero(second):
                joint[a1] += first[a0] * second[a1] * step(a1, (a0, a1))
    return joint


def grammar_engine(method: str, k: int = 3):
    target = BigramLM(TARGET)
    target.config.eos_token_id = None  # the bigram's tokens are all letters here
    if method == "ngram":
        drafter = NgramDrafter(1, 3)
    else:
        drafter = ModelDrafter(BigramLM(DRAFT), 1, 3000, 16, torch.float32, torch.device("cpu"), 0.1)
    engine = make_engine(target, drafter, k=k)
    engine.grammars = vocab_grammars(list(CHARS), stop_ids=[])
    return engine


def sample_masked_joint(engine, settings) -> tuple[np.ndarray, int, dict]:
    """Joint counts of (output[1], output[2]) over NUM_SAMPLES requests, how many
    outputs left the grammar (any token outside it ends a request with an error),
    and the verified and accepted draft counts."""
    guided = GuidedDecoding("choice", json.dumps(CHOICES))
    params = SamplingParams(max_tokens=3, guided=guided, **settings)
    reqs = [engine.add_request(f"r{i}", PROMPT, params) for i in range(NUM_SAMPLES)]
    totals = {"drafted": 0, "accepted": 0}

    def log(stats):
        totals["drafted"] += stats.spec.num_draft_tokens
        totals["accepted"] += stats.spec.num_accepted_tokens

    engine.stat_loggers.append(log)
    while engine.has_unfinished():
        engine.step()
    counts, outside = np.zeros((V, V)), 0
    for r in reqs:
        out = r.output_token_ids
        if r.finish_reason != "length" or len(out) != 3:
            outside += 1
        else:
            counts[out[1], out[2]] += 1
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks
    return counts, outside, totals


def exact_p_value(counts: np.ndarray, outside: int, expected: np.ndarray) -> float:
    """Chi-square p-value of ``counts`` against ``expected``; 0 when any sample fell
    where the masked distribution has no mass."""
    if outside or counts[expected == 0].sum():
        return 0.0
    return p_value(counts, expected)


def test_reference_mask_matches_the_compiled_grammar():
    grammar = vocab_grammars(list(CHARS), stop_ids=[]).matcher(GuidedDecoding("choice", json.dumps(CHOICES)), [])
    for prefix in [(), (0,), (0, 1), (3, 5), (5, 2, 4)]:
        bitmask = torch.zeros(1, 1, dtype=torch.int32)
        grammar.fill(bitmask, 0, prefix)
        got = [(int(bitmask[0, 0]) >> t) & 1 == 1 for t in range(V)]
        assert got == allowed(prefix).tolist(), prefix


# The default suite: the draft model (masked q); prompt lookup's masked drafts under slow.
@pytest.mark.parametrize("method, settings", [pytest.param(*p.values, id=p.id, marks=pytest.mark.slow)
                                              if p.id.startswith("ngram") else p for p in METHOD_SETTINGS])
def test_masked_rounds_emit_the_masked_target_distribution(method, settings):
    counts, outside, totals = sample_masked_joint(grammar_engine(method), settings)
    # Drafts were verified and accepted (and at temperature 1 some rejected).
    assert totals["drafted"] >= NUM_SAMPLES // 20 and totals["accepted"] > totals["drafted"] // 20, totals
    if settings["temperature"] == 1.0:
        assert totals["accepted"] < totals["drafted"], totals
    assert exact_p_value(counts, outside, exact_masked_joint(settings)) > 1e-3


def _unmasked(logits, requests, prefixes=None):
    return logits


@pytest.mark.slow  # a power check: the distribution test it backs runs in the default suite
def test_the_test_rejects_a_drafter_whose_q_is_not_masked(monkeypatch):
    """The draft model samples from its unmasked q (and reports it honestly); its drafts
    outside the grammar are cut, which is exact only for a masked q."""
    monkeypatch.setattr(drafters.draft_model, "mask_logits", _unmasked)
    counts, outside, _ = sample_masked_joint(grammar_engine("draft_model"), SETTINGS[0])
    assert outside == 0  # the target's mask still keeps every output in the grammar
    assert exact_p_value(counts, outside, exact_masked_joint(SETTINGS[0])) < 1e-3


@pytest.mark.slow  # a power check: the distribution test it backs runs in the default suite
def test_the_test_rejects_a_target_whose_p_is_not_masked(monkeypatch):
    monkeypatch.setattr(engine.worker.runner, "apply_bitmask", lambda logits, rows, bitmask: logits)  # the runner's mask
    counts, outside, _ = sample_masked_joint(grammar_engine("ngram"), SETTINGS[0])
    assert exact_p_value(counts, outside, exact_masked_joint(SETTINGS[0])) < 1e-3

