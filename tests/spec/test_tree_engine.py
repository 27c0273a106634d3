"""Token trees through the whole engine: greedy output identical to plain
decoding for every drafter (tiny random model: the tree mask, depth positions
and the accepted path's KV moves all matter), with a float32 and a bfloat16 KV
cache, every block back; and sampling
with trees emits exactly the target's joint distribution (chi-square over
20,000 requests), with a power check."""

import dataclasses

import numpy as np
import pytest
import torch

import engine.worker.runner
import engine.spec_decode.verify
from drafters.draft_model import ModelDrafter
from drafters.ngram import NgramDrafter
from engine import SamplingParams
from engine.spec_decode import tree_sampler
from engine.config import SpeculativeConfig
from engine.llm_engine import LLMEngine
from tests.conftest import check_no_lost_blocks, engine_config
from tests.spec.bigram import BigramLM, bigram_table, perturbed
from tests.spec.distribution import V, exact_joint, joint_counts, p_value

# ---- greedy: identical to plain decoding ----

GREEDY_PROMPTS = [
    [5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 11, 5, 6],  # the suffix "5 6" has three continuations
    [1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2],
    [40, 41, 40, 42, 40, 43, 40],
    # Tokens of this model's outputs in another order: prompt lookup's first branch is wrong
    # there, a later sibling is accepted, and the output depends on its KV having moved.
    [42, 62, 55, 53, 4, 16, 7, 33],
    [33, 52, 2, 33, 3, 18, 51, 62, 45, 42],
]
TREE = dict(tree_width=3, max_tree_nodes=10, num_speculative_tokens=3, adaptive=False)


class Moves:
    """Counts accepted paths that needed their KV moved (an off-first-branch acceptance)."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = engine.worker.runner.move_slots

        def counted(kv, src, dst):
            self.count += 1
            real(kv, src, dst)

        monkeypatch.setattr(engine.worker.runner, "move_slots", counted)


def greedy_run(llm: LLMEngine, max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = [llm.add_request(f"r{i}", p, params) for i, p in enumerate(GREEDY_PROMPTS)]
    while llm.has_unfinished():
        llm.step()
    check_no_lost_blocks(llm)
    if hasattr(llm.speculator.drafter, "kv"):
        assert llm.speculator.drafter.kv.num_free_blocks == llm.speculator.drafter.kv.pool.num_blocks
    return [r.output_token_ids for r in reqs]


def tiny_engine(model, spec: SpeculativeConfig | None = None, drafter=None, kv_cache_dtype: str = "auto") -> LLMEngine:
    config = engine_config(max_model_len=256, num_blocks=128, block_size=4, speculative=spec,
                           kv_cache_dtype=kv_cache_dtype)
    return LLMEngine(config, model=model, tokenizer=None, drafter=drafter)


def drafters(model, draft_model, kv_dtype=torch.float32):
    """name -> (SpeculativeConfig, drafter or None to build it from the config); a draft model's
    own KV cache in ``kv_dtype``."""
    cpu = torch.device("cpu")
    return {
        "ngram": (SpeculativeConfig(method="ngram", **TREE), None),
        "early_exit": (SpeculativeConfig(method="early_exit", num_layers=1, **TREE), None),
        "early_exit-static": (
            SpeculativeConfig(method="early_exit", num_layers=1, adaptive=False,
                              speculative_token_tree="[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]"),
            None,
        ),
        "draft_model": (
            SpeculativeConfig(method="test", **TREE),
            ModelDrafter(draft_model, 2, 128, 4, kv_dtype, cpu, 0.1),
        ),
    }


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("name", ["ngram", "early_exit", "early_exit-static", "draft_model"])
def test_greedy_output_with_trees_equals_plain_decoding(name, kv_cache_dtype, tiny_model, monkeypatch):
    model = tiny_model(vocab_size=64, seed=3)
    draft = tiny_model(vocab_size=64, seed=3, num_hidden_layers=2)  # same weights: drafts often right
    plain = greedy_run(tiny_engine(model, kv_cache_dtype=kv_cache_dtype))
    kv_dtype = torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32
    spec, drafter = drafters(model, draft, kv_dtype)[name]
    llm = tiny_engine(model, spec, drafter, kv_cache_dtype)
    assert llm.paged_kv.k[0].dtype == kv_dtype
    trees = []
    propose = llm.speculator.drafter.propose
    llm.speculator.drafter.propose = lambda slots: trees.append(d := propose(slots)) or d
    moves = Moves(monkeypatch)
    assert greedy_run(llm) == plain
    num_trees = sum(1 for step in trees for d in step.values() if d.parents is not None)
    assert num_trees >= 2
    # The draft model of the same weights always guesses right first: its accepted paths
    # move KV with other weights (test_draft_model_tree_moves_its_own_kv).
    assert moves.count > 0 or name == "draft_model"


def test_draft_model_tree_moves_its_own_kv(tiny_model, monkeypatch):
    """A draft model of other weights: its accepted paths leave the first branch, so
    both caches move entries; outputs stay those of plain decoding."""
    model = tiny_model(vocab_size=64, seed=3)
    draft = tiny_model(vocab_size=64, seed=4)
    plain = greedy_run(tiny_engine(model))
    moved = []
    real = engine.worker.runner.move_slots
    import drafters.draft_model as dm

    monkeypatch.setattr(dm, "move_slots", lambda kv, s, d: moved.append(len(s)) or real(kv, s, d))
    target_moves = Moves(monkeypatch)
    spec, drafter = drafters(model, draft)["draft_model"]
    assert greedy_run(tiny_engine(model, spec, drafter)) == plain
    assert moved and target_moves.count > 0


# ---- sampling: the target's joint distribution ----

NUM_SAMPLES = 20_000
TARGET = bigram_table(V, seed=1)
DRAFT = perturbed(TARGET, seed=2)
# Ends in 0 like tests.spec.distribution.PROMPT (a bigram target sees only the last token),
# and "0" recurs with three continuations, so prompt lookup proposes a tree.
PROMPT = [0, 1, 2, 0, 3, 4, 0, 5, 1, 0]
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)]


def bigram_logits(context: list[int]) -> np.ndarray:
    return np.log(TARGET[context[-1]].double().numpy())


def sampled_run(drafter, settings: dict, monkeypatch) -> np.ndarray:
    """Joint counts of output[1..3] over NUM_SAMPLES requests; checks that trees were
    verified and that second-ranked children were accepted."""
    spec = SpeculativeConfig(method="test", num_speculative_tokens=2, tree_width=3, max_tree_nodes=8,
                             adaptive=False, verify_cost=0.1)
    config = dataclasses.replace(engine_config(max_model_len=64, num_blocks=3000, max_num_seqs=2048,
                                               max_num_batched_tokens=16384), speculative=spec)
    llm = LLMEngine(config, model=BigramLM(TARGET), tokenizer=None, drafter=drafter)
    ranks = []
    real = engine.spec_decode.verify.tree_verify

    def recorded(meta, *args):
        out, acc, nodes = real(meta, *args)
        ranks.append(later_siblings_accepted(meta, nodes))
        return out, acc, nodes

    monkeypatch.setattr(engine.spec_decode.verify, "tree_verify", recorded)
    params = SamplingParams(max_tokens=4, ignore_eos=True, **settings)
    reqs = [llm.add_request(f"r{i}", PROMPT, params) for i in range(NUM_SAMPLES)]
    while llm.has_unfinished():
        llm.step()
    check_no_lost_blocks(llm)
    assert sum(ranks) > NUM_SAMPLES // 100, sum(ranks)  # later siblings were accepted
    return joint_counts([r.output_token_ids for r in reqs])


def later_siblings_accepted(meta, nodes: torch.Tensor) -> int:
    """Accepted nodes that were not their parent's first child. nodes [n, D] (accepted node
    per depth within its request, -1 past the path); rows and children flat (``meta``)."""
    first = meta.first_rows.unsqueeze(1)  # [n, 1]
    parent_rows = first + torch.cat([nodes.new_zeros(len(nodes), 1), nodes[:, :-1] + 1], dim=1)  # [n, D]
    draft_start = (meta.cu_num_draft_tokens - meta.num_draft_tokens).unsqueeze(1)
    first_child = meta.children[:, 0][parent_rows.clamp(min=0)] - draft_start  # [n, D] within the request
    return int(((nodes >= 0) & (first_child != nodes)).sum())


def ngram_tree():
    return NgramDrafter(1, 3)


def model_tree():
    return ModelDrafter(BigramLM(DRAFT), 1, 3000, 16, torch.float32, torch.device("cpu"), 0.1)


SLOW = pytest.mark.slow  # the default suite samples trees through the engine in tests/spec/test_suffix.py
TREE_CASES = [
    pytest.param(ngram_tree, SETTINGS[0], id="ngram-t1.0", marks=SLOW),
    pytest.param(ngram_tree, SETTINGS[1], id="ngram-t0.7-p0.9", marks=SLOW),
    pytest.param(model_tree, SETTINGS[0], id="draft_model-t1.0", marks=SLOW),
    pytest.param(model_tree, SETTINGS[1], id="draft_model-t0.7-p0.9", marks=SLOW),
]


@pytest.mark.parametrize("make_drafter, settings", TREE_CASES)
def test_sampling_with_trees_emits_the_target_joint(make_drafter, settings, monkeypatch):
    counts = sampled_run(make_drafter(), settings, monkeypatch)
    assert p_value(counts, exact_joint(bigram_logits, settings)) > 1e-3


@pytest.mark.parametrize("make_drafter", [pytest.param(ngram_tree, id="ngram", marks=SLOW),
                                          pytest.param(model_tree, id="draft_model", marks=SLOW)])
def test_power_no_residual_update_between_siblings(make_drafter, monkeypatch):
    monkeypatch.setattr(tree_sampler, "residual_distribution", lambda r, q: r)  # every sibling tried against p
    counts = sampled_run(make_drafter(), SETTINGS[0], monkeypatch)
    assert p_value(counts, exact_joint(bigram_logits, SETTINGS[0])) < 1e-3
