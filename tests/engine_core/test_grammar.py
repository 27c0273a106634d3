"""The grammar pieces on a hand-made vocabulary: masks after drafted prefixes,
cutting drafts, when a grammar is done, the compile cache and its errors, and
the logits mask (untouched rows, no cost without a grammar)."""

import json

import pytest
import torch

from engine.spec_decode.drafter import Draft, DraftSlot
from engine.worker.grammar import Grammars
from engine.spec_decode.speculator import cut_to_grammar
from engine.worker.sampler import mask_logits
from engine.sampling_params import GuidedDecoding, InvalidParameter
from tests.grammars import vocab_grammars

VOCAB = ["a", "b", "c", "<eos>"]
EOS = 3


def grammars() -> Grammars:
    return vocab_grammars(VOCAB, stop_ids=[EOS])


def choice(*strings) -> GuidedDecoding:
    return GuidedDecoding("choice", json.dumps(list(strings)))


def allowed(grammar, prefix=()) -> set[int]:
    bitmask = torch.zeros(1, 1, dtype=torch.int32)
    grammar.fill(bitmask, 0, prefix)
    return {t for t in range(len(VOCAB)) if (int(bitmask[0, 0]) >> t) & 1}


def test_masks_follow_drafted_prefixes_without_moving_the_committed_state():
    g = grammars().matcher(choice("ab", "abc", "ca"), [EOS])
    assert allowed(g) == {0, 2}
    assert allowed(g, (0,)) == {1}
    assert allowed(g, (0, 1)) == {2, EOS}  # "ab" is complete: EOS allowed, or "c"
    assert allowed(g, (2,)) == {0}  # a prefix that is not an extension rolls back first
    assert allowed(g, (0, 1, EOS)) == {0, 1, 2, EOS}  # after a stop token: nothing is kept
    assert allowed(g, (1,)) == {0, 1, 2, EOS}  # after a token outside the grammar: same
    assert allowed(g) == {0, 2}
    assert g.accept(0) and allowed(g) == {1}


def test_drafts_are_cut_at_the_first_token_outside_the_grammar():
    g = grammars().matcher(choice("abc"), [EOS])
    assert g.valid_draft_prefix([0, 1, 1]) == 2
    assert g.valid_draft_prefix([1]) == 0
    assert g.valid_draft_prefix([0, 1, 2, EOS, 0]) == 4  # nothing after a stop token
    assert allowed(g) == {0}  # the committed state did not move

    class Req:
        request_id, grammar = "r", g

    probs = torch.rand(3, 4)
    drafts = {"r": Draft([0, 2, 1], probs)}
    out = cut_to_grammar(drafts, [DraftSlot(Req(), 3)])
    assert out["r"].token_ids == [0] and torch.equal(out["r"].probs, probs[:1])
    assert cut_to_grammar({"r": Draft([2])}, [DraftSlot(Req(), 1)]) == {}


def test_a_grammar_is_done_when_complete_and_only_a_stop_token_may_follow():
    g = grammars().matcher(choice("ab", "abc"), [EOS])
    assert g.accept(0) and not g.is_done
    assert g.accept(1) and not g.is_done  # "ab" is complete, but "c" may follow
    assert g.accept(2) and g.is_done
    g = grammars().matcher(choice("ab", "abc"), [EOS])
    assert g.accept(0) and g.accept(1) and g.accept(EOS) and g.is_done  # EOS taken


def test_compiled_grammars_are_cached_least_recently_used_first():
    gs = vocab_grammars(VOCAB, stop_ids=[EOS])
    gs.cache_size = 2
    first = gs.compile(choice("a"))
    assert gs.compile(choice("a")) is first
    gs.compile(choice("b"))
    gs.compile(choice("a"))  # "a" used last: "b" goes first
    gs.compile(choice("c"))
    assert list(gs.cache) == [("choice", '["a"]'), ("choice", '["c"]')]


@pytest.mark.parametrize(
    "spec,named",
    [
        (GuidedDecoding("regex", "a(b", "guided_regex"), "guided_regex is not a valid regular expression"),
        (GuidedDecoding("json", '{"type": "nonsense"}', "response_format"), 'Unsupported type "nonsense"'),
        (GuidedDecoding("json", '{"type": ', "guided_json"), "guided_json is not a valid JSON schema"),
    ],
)
def test_invalid_grammars_name_their_field_and_problem(spec, named):
    with pytest.raises(InvalidParameter) as e:
        grammars().compile(spec)
    assert e.value.param == spec.param and named in str(e.value)
    assert "/project/" not in str(e.value)  # the library's source location is left out


def test_mask_touches_only_rows_with_a_grammar():
    class Req:
        def __init__(self, grammar):
            self.grammar = grammar

    logits = torch.randn(3, len(VOCAB))
    plain = [Req(None), Req(None)]
    assert mask_logits(logits, plain) is logits
    g = grammars().matcher(choice("ab"), [EOS])
    out = mask_logits(logits, [Req(None), Req(g), Req(g)], [(), (), (0,)])
    assert torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1]).tolist() == [True, False, False, False]
    assert torch.isfinite(out[2]).tolist() == [False, True, False, False]
