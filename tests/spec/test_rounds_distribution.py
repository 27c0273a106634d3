"""Every output position of several rounds, through the whole engine, follows the
target's processed distribution given the tokens before it (``tests.spec.rounds``),
on a tiny Llama that uses its KV cache, positions and masks: an EAGLE head's rounds,
``ngram+eagle``'s, and token trees whose batches mix greedy and sampled requests;
and the same check rejects the bugs it is meant to catch (power, stated per test).

Sample sizes are fixed in advance. Power at the stated size is the probability that
the check rejects a bug at p < 1e-3: the noncentrality ``lambda`` the bug gives
(the statistic less its degrees of freedom, measured once at the test's size) at the
test's degrees of freedom (``df``, about 105 at 1,000 requests, 310 at 3,000), by
the noncentral chi-square."""

import pytest
import torch

import drafters.tree_drafting as tree_drafting
from drafters.combined import CombinedDrafter
from drafters.draft_model import ModelDrafter
from drafters.eagle import EagleDrafter
from drafters.ngram import NgramDrafter
from engine import SamplingParams
from engine.spec_decode import rejection_sampler
from tests.spec.distribution import PROMPT, llama_logits, make_engine, resample_from_p, run_groups, tiny_llama
from tests.spec.eagle_heads import random_head
from tests.spec.rounds import conditional_p_value

CPU = torch.device("cpu")
MAX_TOKENS = 8  # output[0] from the prefill, then rounds of up to 2 drafts: 2 to 7 rounds
T1 = dict(temperature=1.0)
TREE = dict(tree_width=3, max_tree_nodes=6)


def eagle3(target) -> EagleDrafter:
    head = random_head(target, "eagle3", seed=3, draft_vocab=5, std=0.5)
    return EagleDrafter(head, 3000, 16, torch.float32, CPU, 0.1)


def ngram_eagle3(target) -> CombinedDrafter:
    """Bigram lookup (a unigram match would always be found, PROMPT holds every token):
    the head drafts where the context's last two tokens have not occurred before."""
    return CombinedDrafter(NgramDrafter(2, 3), eagle3(target))


def model_drafter(target) -> ModelDrafter:
    return ModelDrafter(tiny_llama(seed=1), 3, 3000, 16, torch.float32, CPU, 0.1)


def sampled_outputs(target, drafter, n: int, settings: dict = T1, **tree) -> list[list[int]]:
    engine = make_engine(target, drafter, k=2, **tree)
    (outputs,), spec = run_groups(engine, [(SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **settings), n)])
    assert 0.05 < spec.accepted / spec.drafted < 0.95, (spec.accepted, spec.drafted)
    return outputs


def plain_q_for_siblings(draw):
    """The bug: every sibling sent with the plain q, though it was drawn without its elder
    siblings (its real q is q with them zeroed and renormalized)."""
    return lambda q, logits, greedy, count, noise: [
        (t, None if q_i is None else q / q.sum()) for t, q_i in draw(q, logits, greedy, count, noise)
    ]


# ---- an EAGLE head's and ngram+eagle's rounds ----

# Resampling from p after a rejection: lambda 170 (eagle3) and 190 (ngram+eagle3) at
# 1,000 requests, df about 105: power > 0.999.
NUM_EAGLE = 1000


def test_eagle_rounds_emit_the_target_distribution():
    target = tiny_llama()
    outputs = sampled_outputs(target, eagle3(target), NUM_EAGLE)
    assert conditional_p_value(outputs, llama_logits(target), T1) > 1e-3


def test_ngram_eagle_rounds_emit_the_target_distribution():
    target = tiny_llama()
    drafter = ngram_eagle3(target)
    used = {"lookup": 0, "eagle": 0}
    for name in used:
        propose = getattr(drafter, name).propose
        setattr(getattr(drafter, name), "propose", lambda slots, name=name, propose=propose: (
            used.__setitem__(name, used[name] + len(slots)) or propose(slots)))
    outputs = sampled_outputs(target, drafter, NUM_EAGLE)
    assert used["lookup"] > NUM_EAGLE // 10 and used["eagle"] > NUM_EAGLE // 10  # both drafted, often
    assert conditional_p_value(outputs, llama_logits(target), T1) > 1e-3


@pytest.mark.parametrize("make", [eagle3, pytest.param(ngram_eagle3, marks=pytest.mark.slow)],
                         ids=["eagle3", "ngram+eagle3"])
def test_power_the_eagle_rounds_check_rejects_resampling_from_p(make, monkeypatch):
    monkeypatch.setattr(rejection_sampler, "residual_distribution", resample_from_p)
    target = tiny_llama()
    assert conditional_p_value(sampled_outputs(target, make(target), NUM_EAGLE), llama_logits(target), T1) < 1e-3


# ---- token trees: greedy and sampled requests in one batch; q per sibling ----

# Plain q for every sibling: lambda 700 (draft_model) and 460 (early_exit) at 1,000
# requests, df about 105: power > 0.999. The random EAGLE head's later siblings are
# rarely accepted: lambda 6 at 1,000 requests, 166 at 3,000 (df about 310): power 0.99.
NUM_TREES = 1000
NUM_EAGLE_TREES = 3000


def test_a_tree_batch_of_greedy_and_sampled_requests_emits_each_ones_distribution():
    """The greedy requests outlive the sampled ones: the sampled requests' last rounds, their
    trees cut by ``max_tokens``, run beside deeper greedy trees (depths of greedy trees only,
    which crashed the drafter). Every round drafts, and each group gets its own distribution."""
    target = tiny_llama()
    engine = make_engine(target, model_drafter(target), k=2, **TREE)
    stats = []
    engine.stat_loggers.append(stats.append)
    greedy = SamplingParams(max_tokens=2 * MAX_TOKENS, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **T1)
    (g_out, s_out), spec = run_groups(engine, [(greedy, 100), (sampled, NUM_TREES)])
    assert sum(s.spec.num_fallbacks for s in stats) == 0 and spec.drafted > NUM_TREES
    assert g_out == [_greedy(target, 2 * MAX_TOKENS)] * len(g_out)
    assert conditional_p_value(s_out, llama_logits(target), T1) > 1e-3


def _greedy(target, n: int) -> list[int]:
    out, logits = [], llama_logits(target)
    for _ in range(n):
        out.append(int(logits(PROMPT + out).argmax()))
    return out


@pytest.mark.parametrize("make, n", [
    (model_drafter, NUM_TREES),
    pytest.param(lambda t: None, NUM_TREES, marks=pytest.mark.slow),
    pytest.param(eagle3, NUM_EAGLE_TREES, marks=pytest.mark.slow),
], ids=["draft_model", "early_exit", "eagle3"])
def test_power_the_tree_check_rejects_plain_q_for_siblings(make, n, monkeypatch):
    monkeypatch.setattr(tree_drafting, "draw_children", plain_q_for_siblings(tree_drafting.draw_children))
    target = tiny_llama()
    outputs = sampled_outputs(target, make(target), n, **TREE)
    assert conditional_p_value(outputs, llama_logits(target), T1) < 1e-3
