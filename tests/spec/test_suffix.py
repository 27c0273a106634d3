"""Suffix decoding (drafters.suffix): the index's drafts on known sequences, greedy output
identical to plain decoding through the engine (trees and chains, the global tree on and
off), and sampling with suffix trees emits exactly the target's joint distribution
(chi-square over 20,000 requests, each drafting from every earlier request's output)
with a power check."""

import pytest

from drafters.suffix import SuffixDrafter, SuffixIndex
from engine.config import SpeculativeConfig
from engine.spec_decode import tree_sampler
from tests.spec.test_tree_engine import (
    SETTINGS,
    bigram_logits,
    greedy_run,
    sampled_run,
    tiny_engine,
)
from tests.conftest import check_no_lost_blocks
from tests.spec.distribution import exact_joint, p_value
from tests.spec.seeded_engines import PROMPT, build
from tests.spec.test_seeded_traffic import SEEDED, others, record_drafts, same_drafts, serve

# ---- the index ----


def test_continuations_branch_and_are_scored_by_frequency():
    ix = SuffixIndex(max_depth=24, max_cached=10)
    sid = ix.open(out_start=0, shared=True)
    # "1 2 3" is followed by "4 5" twice and by "7" once.
    ix.append(sid, [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 5, 8, 1, 2, 3, 7, 0, 1, 2, 3])
    tokens, parents, probs, n = ix.speculate(sid, True, 8, [2, 1], 2.0, 0.1)  # two levels: 2 roots, 1 child
    assert n == 3  # the longest pattern that occurs: "1 2 3" ("0 1 2 3" only at the end itself)
    assert tokens == [4, 5, 7, 0]
    assert parents == (-1, 0, -1, 2)
    assert probs == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3])
    # min_token_prob prunes the branch; one child per node gives a chain
    assert ix.speculate(sid, True, 8, [2, 1, 1], 2.0, 0.5)[:2] == ([4, 5], (-1, 0))
    # max_spec_factor: at most n * factor drafts
    assert len(ix.speculate(sid, True, 8, [2, 1], 1 / 3, 0.1)[0]) == 1


def test_global_tree_serves_other_requests_and_evicts_fifo():
    ix = SuffixIndex(max_depth=24, max_cached=1)
    a = ix.open(out_start=2, shared=True)
    ix.append(a, [50, 51, 10, 11, 12, 13, 14])  # output 10 .. 14
    b = ix.open(out_start=2, shared=True)
    ix.append(b, [60, 61, 10, 11])
    assert ix.speculate(b, True, 8, [1] * 8, 1.0, 0.1)[0] == [12, 13]  # a's output, while a runs
    assert ix.speculate(b, False, 8, [1] * 8, 1.0, 0.1)[0] == []  # own tree only
    ix.close(a)
    assert ix.speculate(b, True, 8, [1] * 8, 1.0, 0.1)[0] == [12, 13]  # kept after it ends
    c = ix.open(out_start=1, shared=True)
    ix.close(c)  # one cached request at most: a is evicted, oldest first
    assert ix.speculate(b, True, 8, [1] * 8, 1.0, 0.1)[0] == []


def test_no_global_tree_with_zero_cached_requests():
    ix = SuffixIndex(max_depth=24, max_cached=0)
    a = ix.open(out_start=1, shared=True)
    ix.append(a, [50, 10, 11, 12, 13])
    b = ix.open(out_start=1, shared=True)
    ix.append(b, [60, 10, 11])
    assert ix.speculate(b, True, 8, [1] * 8, 1.0, 0.1)[0] == []


def test_vllm_keys_and_defaults():
    spec = SpeculativeConfig.from_dict({"method": "suffix"})
    assert (spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests) == (24, 10000)
    assert (spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob) == (1.0, 0.1)
    assert spec.num_speculative_tokens == 24 and spec.uses_trees
    spec = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8,
                                        "suffix_decoding_max_cached_requests": 0})
    assert spec.num_speculative_tokens == 8 and spec.suffix_decoding_max_cached_requests == 0
    for bad in ({"suffix_decoding_min_token_prob": 1.5}, {"suffix_decoding_max_cached_requests": -1},
                {"suffix_decoding_max_tree_depth": 1}, {"suffix_decoding_max_spec_factor": 0}):
        with pytest.raises(ValueError, match="suffix_decoding"):
            SpeculativeConfig.from_dict({"method": "suffix", **bad})


# ---- greedy: identical to plain decoding ----


@pytest.mark.parametrize("tree_width, max_cached", [(3, 10000), (1, 10000), (3, 0)], ids=["trees", "chains", "own"])
def test_greedy_output_equals_plain_decoding(tree_width, max_cached, tiny_model):
    model = tiny_model(vocab_size=64, seed=3)
    plain = greedy_run(tiny_engine(model))
    spec = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 6, "tree_width": tree_width,
                                        "max_tree_nodes": 10, "adaptive": False,
                                        "suffix_decoding_max_cached_requests": max_cached,
                                        "suffix_decoding_max_spec_factor": 2.0})
    llm = tiny_engine(model, spec)
    assert isinstance(llm.speculator.drafter, SuffixDrafter)
    drafts = []
    propose = llm.speculator.drafter.propose
    llm.speculator.drafter.propose = lambda slots: drafts.append(d := propose(slots)) or d
    assert greedy_run(llm) == plain
    assert sum(len(d.token_ids) for step in drafts for d in step.values()) > 20
    assert any(d.parents is not None for step in drafts for d in step.values()) == (tree_width > 1)
    assert not llm.speculator.drafter.seqs  # every request's state dropped


# ---- sampling: the target's joint distribution ----


def suffix_tree():
    return SuffixDrafter(max_depth=24, max_cached=10000, max_spec_factor=2.0, min_token_prob=0.05)


@pytest.mark.parametrize("settings", [pytest.param(SETTINGS[0], id="t1.0"),
                                      pytest.param(SETTINGS[1], id="t0.7-p0.9", marks=pytest.mark.slow)])
def test_sampling_with_suffix_trees_emits_the_target_joint(settings, monkeypatch):
    counts = sampled_run(suffix_tree(), settings, monkeypatch)
    assert p_value(counts, exact_joint(bigram_logits, settings)) > 1e-3


def test_power_no_residual_update_between_siblings(monkeypatch):
    monkeypatch.setattr(tree_sampler, "residual_distribution", lambda r, q: r)  # every sibling tried against p
    counts = sampled_run(suffix_tree(), SETTINGS[0], monkeypatch)
    assert p_value(counts, exact_joint(bigram_logits, SETTINGS[0])) < 1e-3


# ---- seeded requests: their own tree only ----


@pytest.mark.parametrize("name", [pytest.param("suffix", marks=pytest.mark.slow), "suffix-tree"])
def test_a_seeded_request_drafts_the_same_alone_and_beside_others(name, tmp_path):
    """A seeded request drafts from its own tree only: the same drafts and tokens alone and
    after and beside other requests whose outputs fill the global tree; drafting from the
    global tree too (the power check) changes its drafts."""
    outputs, drafts = seeded_runs(name, tmp_path, own_only=True)
    assert outputs["s-beside"] == outputs["s-alone"] == outputs["s-after"]
    assert same_drafts(drafts["s-beside"], drafts["s-alone"]) and same_drafts(drafts["s-after"], drafts["s-alone"])
    assert sum(len(d[0]) for d in drafts["s-alone"]) > 10
    _, shared = seeded_runs(name, tmp_path, own_only=False)
    assert not same_drafts(shared["s-beside"], shared["s-alone"])


def seeded_runs(name: str, tmp_path, own_only: bool):
    engine = build(name, tmp_path)
    if not own_only:  # the power check: seeded requests read the global tree as the others do
        sync = engine.speculator.drafter._sync
        engine.speculator.drafter._sync = lambda request: (st := sync(request)) and st[:2] + [False]
    drafts = record_drafts(engine)
    out = serve(engine, [("s-alone", PROMPT, SEEDED)])
    serve(engine, others("warm", 12))
    out |= serve(engine, others("busy", 15) + [("s-beside", PROMPT, SEEDED)])
    out |= serve(engine, [("s-after", PROMPT, SEEDED)])
    check_no_lost_blocks(engine)
    return out, drafts
