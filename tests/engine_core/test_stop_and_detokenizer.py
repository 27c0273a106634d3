"""Stop conditions applied token by token (also inside a run of several
accepted tokens) and incremental detokenization of multi-byte characters,
with the default model's tokenizer and no model."""

import pytest

from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.stop import append_tokens, holdback

TEXT = " The weather today is sunny, with a light breeze from the west."


@pytest.fixture(scope="module")
def tok(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_path)


def make_request(tok, max_tokens=64, eos=frozenset({2}), **kw) -> Request:
    prompt = tok.encode("Weather report:", add_special_tokens=False)
    return Request("r", prompt, SamplingParams(max_tokens=max_tokens, **kw), eos, tok)


def test_incremental_detokenizer_never_emits_a_broken_character(tok):
    text = "héllo 日本語 🙂🚀 naïve ok"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some tokens are pieces of a character
    prompt = tok.encode("Say:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.decode_next(prompt + ids[: i + 1]) for i in range(len(ids))]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids)
    assert "" in deltas  # held back while a character was incomplete


def test_stop_string_inside_a_run_of_accepted_tokens_drops_the_rest(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    req = make_request(tok, stop=("sunny, with",))
    kept = append_tokens(req, ids, max_model_len=1000)
    assert req.is_finished and req.finish_reason == "stop"
    assert req.output_text == " The weather today is "
    assert req.output_token_ids == ids[:kept] and kept < len(ids)
    assert "sunny, with" in tok.decode(ids[:kept]) and "sunny, with" not in tok.decode(ids[: kept - 1])


def test_include_stop_str_and_the_earliest_of_several_stops(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    req = make_request(tok, stop=("breeze", "sunny"), include_stop_str_in_output=True)
    append_tokens(req, ids, max_model_len=1000)
    assert req.output_text == " The weather today is sunny"


def test_stop_token_eos_and_max_tokens_inside_a_run(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    by_id = make_request(tok, stop_token_ids=(ids[3],))
    assert append_tokens(by_id, ids, 1000) == 4 and by_id.finish_reason == "stop"
    by_eos = make_request(tok)
    assert append_tokens(by_eos, ids[:2] + [2] + ids[2:], 1000) == 3 and by_eos.output_token_ids[-1] == 2
    assert by_eos.output_text == tok.decode(ids[:2])  # EOS is a special token: not in the text
    ignoring = make_request(tok, ignore_eos=True)
    assert append_tokens(ignoring, ids[:2] + [2] + ids[2:4], 1000) == 5 and not ignoring.is_finished
    by_len = make_request(tok, max_tokens=5)
    assert append_tokens(by_len, ids, 1000) == 5 and by_len.finish_reason == "length"
    by_ctx = make_request(tok)  # the context reaches max_model_len
    assert append_tokens(by_ctx, ids, max_model_len=by_ctx.num_tokens + 3) == 3 and by_ctx.finish_reason == "length"


def test_holdback_covers_a_forming_stop_string(tok):
    req = make_request(tok, stop=("abc", "longer stop"))
    assert holdback(req) == len("longer stop") - 1
    assert holdback(make_request(tok)) == 0
    req.finish("stop")
    assert holdback(req) == 0  # a finished request shows all of its (truncated) text
