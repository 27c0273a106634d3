"""EAGLE heads: the loader reads the published formats and refuses a head that does not
fit its target; drafting from the verification pass's own features drafts exactly what
the head predicts from the committed context (nothing of a rejected round survives),
and never changes greedy output."""

import json

import pytest
import torch

from drafters.eagle_head import load_eagle_head
from engine import SamplingParams
from engine.utils import tree
from engine.attention import SeqSpec, build_attention_metadata
from engine.attention.backends import CPU, TORCH
from engine.layers import cpu_kernels
from engine.models.decoder import head_dim_of
from kvcache.tensors import KVSpec, PagedKV
from tests.engine_core.engine_helpers import greedy
from tests.spec.eagle_heads import PROMPTS, eagle_engine, run, small_target, write_random_head

KINDS = [("eagle", {}), ("eagle3", {"draft_vocab": 12})]


TREE = {"tree_width": 3, "max_tree_nodes": 8}


@pytest.mark.parametrize("tree", [{}, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("kind,kw", KINDS, ids=["eagle", "eagle3"])
def test_greedy_output_is_plain_decoding(tmp_path, kind, kw, tree):
    model = small_target()
    head = write_random_head(model, kind, tmp_path / kind, **kw)
    engine = eagle_engine(model, kind, head, **tree)
    drafted = []
    engine.stat_loggers.append(lambda s: drafted.append((s.spec.num_draft_tokens, s.spec.num_accepted_tokens)))
    assert run(engine, PROMPTS) == run(eagle_engine(model), PROMPTS)
    assert sum(d for d, _ in drafted) > 50 and 0 < sum(a for _, a in drafted)


@torch.inference_mode()
def fresh_logits(model, head, context: list[int], branch: list[int]) -> torch.Tensor:
    """The head's draft logits [vocab] after ``context`` and the guessed ``branch``, computed
    from scratch: the target's features of a fresh prefill, every pair fed at once, then one
    guessed pair per branch token."""
    cfg = model.config
    kv = PagedKV(KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), 16, torch.float32), 16, "cpu")
    n = len(context) - 1  # pairs (f_p, t_{p+1}) for p < n
    meta = build_attention_metadata([SeqSpec(0, n, list(range(16)))], 16)
    _, feats = model(torch.tensor(context[:-1]), torch.arange(n), meta, kv, capture=head.feature_layers)
    hkv = PagedKV(KVSpec(1, head.num_kv_heads, head.head_dim, 16, torch.float32), 16, "cpu")

    def last_output(ids, hidden, pos):
        meta = build_attention_metadata([SeqSpec(int(pos[0]), len(ids), list(range(16)))], 16)
        return head(ids, hidden, pos, meta, hkv)[-1:]

    out = last_output(torch.tensor(context[1:]), head.fuse(feats), torch.arange(n))  # the context's pairs
    for i, token in enumerate(branch):  # then each branch token with the head's last output
        out = last_output(torch.tensor([token]), out, torch.tensor([n + i]))
    return head.draft_logits(out)[0]


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C kernels on this machine")
@pytest.mark.parametrize("kind,kw", KINDS, ids=["eagle", "eagle3"])
def test_the_one_call_layer_is_the_heads_layer(tmp_path, kind, kw):
    """On the CPU backend's metadata the loaded head runs its layer in one C call: its
    outputs and cache entries are those of the layer-by-layer forward, for a run of
    pairs and then a tree over them."""
    model = small_target()
    head = load_eagle_head(write_random_head(model, kind, tmp_path / kind, **kw), kind, model, torch.float32, "cpu", 256)
    gen = torch.Generator().manual_seed(0)
    caches = {b: PagedKV(KVSpec(1, head.num_kv_heads, head.head_dim, 16, torch.float32), 4, "cpu") for b in (TORCH, CPU)}
    parents = (-1, 0, 0, 1, 3)
    feeds = [(SeqSpec(0, 7, [0, 1]), torch.arange(7)),
             (SeqSpec(7, len(parents), [0, 1], parents), 7 + torch.from_numpy(tree.depths(parents)))]
    for spec, positions in feeds:
        ids = torch.randint(0, 16, (len(positions),), generator=gen)
        hidden = torch.randn(len(positions), model.config.hidden_size, generator=gen)
        with torch.inference_mode():
            outs = {b: head(ids, hidden, positions, b.build_metadata([spec], 16), caches[b]) for b in (TORCH, CPU)}
        assert CPU.build_metadata([spec], 16).lists_all(len(ids))
        torch.testing.assert_close(outs[CPU], outs[TORCH], rtol=1e-4, atol=1e-4)
    for a, b in zip(caches[CPU].layer(0), caches[TORCH].layer(0)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def fresh_drafts(model, head, context: list[int], k: int) -> list[int]:
    """The head's greedy chain of ``k`` drafts after ``context``, from scratch."""
    drafts: list[int] = []
    for _ in range(k):
        drafts.append(int(fresh_logits(model, head, context, drafts).argmax()))
    return drafts


@pytest.mark.parametrize("kind,kw", KINDS, ids=["eagle", "eagle3"])
def test_drafts_are_the_heads_predictions_from_the_committed_context(tmp_path, kind, kw):
    """Every round's drafts equal a from-scratch computation over the committed tokens:
    the features handed over, the pairs fed and the rollback of guessed pairs are right."""
    model = small_target()
    engine = eagle_engine(model, kind, write_random_head(model, kind, tmp_path / kind, **kw))
    rounds, propose = [], engine.speculator.drafter.propose

    def record(slots):
        drafts = propose(slots)
        rounds.extend((list(s.request.token_ids), drafts[s.request.request_id].token_ids) for s in slots
                      if s.request.request_id in drafts)
        return drafts

    engine.speculator.drafter.propose = record
    run(engine, PROMPTS[:2], max_tokens=24)
    assert len(rounds) >= 10
    head = engine.speculator.drafter.head
    for context, drafts in rounds:
        assert drafts == fresh_drafts(model, head, context, len(drafts))


@pytest.mark.parametrize("kind,kw", KINDS, ids=["eagle", "eagle3"])
def test_tree_drafts_are_the_heads_top_tokens_after_each_branch(tmp_path, kind, kw):
    """Every node's children in a greedy tree round are the head's best tokens after that
    node's branch, as a from-scratch computation gives them: each node fed with its own
    parent's output, at its depth, attending to its ancestors only."""
    model = small_target()
    engine = eagle_engine(model, kind, write_random_head(model, kind, tmp_path / kind, **kw), **TREE)
    rounds, propose = [], engine.speculator.drafter.propose

    def record(slots):
        drafts = propose(slots)
        rounds.extend((list(s.request.token_ids), drafts[s.request.request_id]) for s in slots
                      if s.request.request_id in drafts)
        return drafts

    engine.speculator.drafter.propose = record
    run(engine, PROMPTS[:2], max_tokens=16)
    trees = [(c, d) for c, d in rounds if d.parents is not None]
    assert len(trees) >= 5
    head = engine.speculator.drafter.head
    for context, draft in trees:
        for node in [-1, *range(len(draft.parents))]:
            kids = [draft.token_ids[i] for i, p in enumerate(draft.parents) if p == node]
            if kids:
                branch = [draft.token_ids[i] for i in tree.path(draft.parents, node)] if node >= 0 else []
                logits = fresh_logits(model, head, context, branch)
                assert kids == logits.topk(len(kids)).indices.tolist(), (node, logits.topk(4), len(context))


def edit_config(path, **changes):
    file = path / "config.json"
    config = json.loads(file.read_text())
    config.update(changes)
    file.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda p: edit_config(p, hidden_size=32), "hidden size 32 differs"),
        (lambda p: edit_config(p, vocab_size=99), "vocabulary of 99 differs"),
        (lambda p: edit_config(p, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}), "feature layer ids"),
        (lambda p: edit_config(p, intermediate_size=64), "has shape"),
        (lambda p: (p / "model.safetensors").rename(p / "pytorch_model.bin"), "never loaded"),
    ],
    ids=["hidden", "vocab", "layers", "shape", "pickle"],
)
def test_a_head_that_does_not_fit_is_refused_at_start_up(tmp_path, change, message):
    model = small_target()
    path = write_random_head(model, "eagle3", tmp_path / "head", draft_vocab=12)
    change(path)
    with pytest.raises(ValueError, match=message):
        eagle_engine(model, "eagle3", path)


def test_a_reduced_vocabulary_drafts_only_its_tokens(tmp_path):
    model = small_target()
    head = load_eagle_head(write_random_head(model, "eagle3", tmp_path / "h", draft_vocab=5), "eagle3",
                           model, torch.float32, "cpu", 256)
    logits = head.draft_logits(torch.randn(7, 64))  # [7, vocab]
    allowed = torch.zeros(16, dtype=torch.bool)
    allowed[head.draft_to_target] = True
    assert torch.isinf(logits[:, ~allowed]).all() and torch.isfinite(logits[:, allowed]).all()
    assert allowed.sum() == 5


@pytest.mark.parametrize("method, tree", [
    pytest.param("ngram+eagle3", {}, id="ngram-chain"), pytest.param("ngram+eagle3", TREE, id="ngram-tree"),
    pytest.param("suffix+eagle3", {}, id="suffix-chain", marks=pytest.mark.slow),
    pytest.param("suffix+eagle3", TREE, id="suffix-tree"),
])
def test_the_combination_is_exact_and_uses_both_drafters(tmp_path, tree, method):
    model = small_target()
    head = write_random_head(model, "eagle3", tmp_path / "h", draft_vocab=12)
    engine = eagle_engine(model, method, head, **tree)
    used, propose = {"lookup": 0, "eagle": 0}, {n: getattr(engine.speculator.drafter, n).propose for n in ("lookup", "eagle")}
    for name in used:
        def count(slots, name=name):
            used[name] += len(slots)
            return propose[name](slots)
        setattr(getattr(engine.speculator.drafter, name), "propose", count)
    prompts = PROMPTS + [[5, 6, 7, 8] * 6]  # repetitive: prompt lookup matches
    assert run(engine, prompts) == run(eagle_engine(model), prompts)
    assert used["lookup"] > 0 and used["eagle"] > 0


def test_the_combination_counts_a_trees_accepted_branch():
    from drafters.combined import _accepted
    from engine.spec_decode.drafter import Draft

    #   5 - 6      the target went 7, 8, then 3: the second guess and its child
    #   7 - 8 - 9
    draft = Draft([5, 7, 6, 8, 9], None, (-1, -1, 0, 1, 3))
    assert _accepted(draft, [7, 8, 3]) == 2
    assert _accepted(draft, [7, 8, 9, 1]) == 3
    assert _accepted(draft, [6]) == 0
    assert _accepted(Draft([1, 2, 3]), [1, 2, 4]) == 2


def test_the_combination_picks_by_past_records(tmp_path):
    from drafters.combined import EAGLE_CLASS, _Record

    model = small_target()
    engine = eagle_engine(model, "ngram+eagle3", write_random_head(model, "eagle3", tmp_path / "h", draft_vocab=12))
    drafter = engine.speculator.drafter
    req = engine.add_request("r", list(range(16)), greedy(8))
    engine.step()  # prefill: the head has the prompt's features; every token occurred before
    assert drafter.lookup.context_class(req) is not None
    assert drafter.context_class(req) == drafter.lookup.context_class(req)  # no record yet: lookup is tried
    n = drafter.lookup.context_class(req)
    drafter.records[n] = _Record(drafted=4.0, accepted=0.0, rounds=10)
    drafter.records[EAGLE_CLASS] = _Record(drafted=3.0, accepted=2.0, rounds=10)
    assert drafter.context_class(req) == EAGLE_CLASS
    drafter.records[n] = _Record(drafted=4.0, accepted=3.0, rounds=10)
    assert drafter.context_class(req) == n
    while engine.has_unfinished():
        engine.step()


def test_a_seeded_request_picks_by_its_own_records_only(tmp_path):
    """The pooled records say prompt lookup does not pay: an unseeded request takes the
    head; a seeded one has no record of its own yet, so it tries lookup as on a fresh server."""
    from drafters.combined import EAGLE_CLASS, _Record

    model = small_target()
    engine = eagle_engine(model, "ngram+eagle3", write_random_head(model, "eagle3", tmp_path / "h", draft_vocab=12))
    drafter = engine.speculator.drafter
    seeded = engine.add_request("s", list(range(16)), SamplingParams(max_tokens=8, temperature=1.0, seed=3))
    plain = engine.add_request("u", list(range(16)), SamplingParams(max_tokens=8, temperature=1.0))
    engine.step()  # prefill: the head has the prompts' features; every token occurred before
    n = drafter.lookup.context_class(seeded)
    drafter.records[n] = _Record(drafted=4.0, accepted=0.0, rounds=10)
    drafter.records[EAGLE_CLASS] = _Record(drafted=3.0, accepted=2.0, rounds=10)
    assert drafter.context_class(plain) == EAGLE_CLASS
    assert drafter.context_class(seeded) == n
    while engine.has_unfinished():
        engine.step()
