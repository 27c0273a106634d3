from engine.spec_decode.drafter import DraftSlot
from drafters.ngram import NgramDrafter, NgramIndex
from engine.core.request import Request
from engine.sampling_params import SamplingParams


def ngram_draft(context: list, n: int, k: int) -> list:
    """The prompt-lookup rule on a plain list (any hashable tokens), backing off to suffixes of 1."""
    return NgramIndex(1, n).propose(list(context), k)


def test_reference_example():
    assert ngram_draft("a b c X a b c Y a b c".split(), 3, 2) == ["Y", "a"]


def test_backs_off_to_shorter_suffixes_and_gives_up():
    assert ngram_draft("x a y z a".split(), 3, 3) == ["y", "z", "a"]  # only "a" recurs
    assert ngram_draft("a b c d".split(), 3, 2) == []
    assert ngram_draft([], 3, 2) == [] and ngram_draft([7], 3, 2) == []


def test_most_recent_occurrence_wins_and_never_the_suffix_itself():
    assert ngram_draft("a 1 a 2 a".split(), 1, 1) == ["2"]
    assert ngram_draft("a a".split(), 2, 3) == ["a"]


def test_index_is_incremental_and_matches_a_fresh_scan():
    tokens = [1, 2, 3, 1, 2, 4, 1, 2, 3, 5, 1, 2]
    index = NgramIndex(1, 3)
    for end in range(1, len(tokens) + 1):
        prefix = tokens[:end]
        assert index.propose(prefix, 3) == NgramIndex(1, 3).propose(prefix, 3)
    assert index.num_indexed_ends == len(tokens) - 1


def test_drafter_proposes_per_request_and_forgets():
    req = Request("r", [5, 6, 7, 5, 6], SamplingParams(), frozenset())
    drafter = NgramDrafter(1, 3)
    drafts = drafter.propose([DraftSlot(req, 4)])
    assert drafts["r"].token_ids == [7, 5, 6] and drafts["r"].probs is None
    drafter.free("r")
    assert "r" not in drafter.indexes


def test_context_class_is_the_match_length_from_committed_tokens_only():
    drafter = NgramDrafter(1, 4)
    req = Request("r", [5, 6, 7, 8, 1, 6, 7], SamplingParams(), frozenset())
    assert drafter.context_class(req) == 2  # "6 7" recurs
    assert drafter.propose([DraftSlot(req, 3)])["r"].token_ids == [8, 1, 6]
    lonely = Request("s", [1, 2, 3], SamplingParams(), frozenset())
    assert drafter.context_class(lonely) is None and drafter.propose([DraftSlot(lonely, 3)]) == {}


def test_commit_keeps_the_index_up_to_date_and_rebuilds_it_after_a_rollback():
    """Planning after a pause then finds nothing to catch up on; a rollback past the index
    (tokens removed) must not leave n-grams of the removed tokens behind."""
    drafter = NgramDrafter(1, 3)
    req = Request("r", [1, 2, 3, 1, 2], SamplingParams(), frozenset())
    for more in ([3, 9, 1, 2], []):
        req.token_ids += more
        drafter.commit(req)
        assert drafter.indexes["r"].num_indexed_ends == req.num_tokens - 1
    del req.token_ids[-3:]  # [1, 2, 3, 1, 2, 3]
    drafter.commit(req)
    assert drafter.propose([DraftSlot(req, 3)])["r"].token_ids == [1, 2, 3]  # after the first "1 2 3"
