"""The tool-call format read as it is written (server/tool_calls.py), without the model:
a stream fed an answer in any cut sends the same calls that parsing it whole gives."""

import json
import random

import pytest

from server.tool_calls import CallStream, NotACall, scan
from server.tools import Tools

NAMES = frozenset({"add", "get_weather"})
TOOLS = Tools(({"name": "add"}, {"name": "get_weather"}), "auto")

CALLS = [
    '{"name": "add", "arguments": {"a": 1, "b": 2}}',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo \\"}{\\" x", "unit": "celsius"}}</tool_call>',
    '[{"name": "add", "arguments": {}}, {"name": "add", "arguments": {"a": [1, {"b": "]"}]}}]',
    '{"arguments": {"a": 7}, "name": "add"}',  # arguments before the name
    '{"name": "add", "parameters": {"a": 1}, "id": 3}',
    '{"name": "add"}',  # no arguments: {}
    '  {"name": "add", "arguments": {"a": 1}} and then the model says more',
]


def stream_all(text: str, cuts: list[int]) -> tuple[CallStream, list]:
    stream, pieces, start = CallStream(NAMES), [], 0
    for end in [*cuts, len(text)]:
        pieces += stream.feed(text[start:end])
        start = end
    return stream, pieces


def assemble(pieces: list) -> list[dict]:
    """What a client builds from the deltas (as the openai SDK's stream state does)."""
    calls: list[dict] = []
    for p in pieces:
        if p.index == len(calls):
            assert p.id and p.type == "function" and p.function.name and p.function.arguments == "", p
            calls.append({"id": p.id, "name": p.function.name, "arguments": ""})
        else:
            assert p.index == len(calls) - 1 and p.id is None and p.function.name is None, p
            calls[p.index]["arguments"] += p.function.arguments
    return calls


@pytest.mark.parametrize("text", CALLS)
@pytest.mark.parametrize("seed", range(4))
def test_any_cut_streams_what_parsing_the_whole_gives(text, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if seed else list(range(1, len(text)))
    stream, pieces = stream_all(text, cuts)
    whole = TOOLS.parse(text)
    assert whole is not None and stream.started and not stream.rejected
    got = assemble(pieces)
    assert [c["name"] for c in got] == [c.function.name for c in whole]
    assert [json.loads(c["arguments"]) for c in got] == [json.loads(c.function.arguments) for c in whole]
    assert len({c["id"] for c in got}) == len(got)


def test_arguments_go_out_piece_by_piece():
    text = CALLS[0]
    _, pieces = stream_all(text, list(range(1, len(text))))
    args = [p.function.arguments for p in pieces[1:]]
    assert len(args) == len('{"a": 1, "b": 2}') and "".join(args) == '{"a": 1, "b": 2}'
    assert pieces[0].model_dump() == {"index": 0, "id": pieces[0].id, "type": "function",
                                      "function": {"name": "add", "arguments": ""}}
    assert pieces[1].model_dump() == {"index": 0, "function": {"arguments": "{"}}


@pytest.mark.parametrize("text", [
    "The weather is fine.",
    '{"name": "unknown", "arguments": {}}',
    '{"name": "add", "arguments": "1, 2"}',
    '{"city": "Oslo"}',
    "[1, 2]",
])
def test_an_answer_that_cannot_be_a_call_is_rejected_before_any_piece(text):
    stream, pieces = stream_all(text, list(range(1, len(text))))
    assert stream.rejected and not pieces and TOOLS.parse(text) is None


@pytest.mark.parametrize("text", ["", "<tool", '{"na', '{"name": "ad', '[{"name": "add", "arguments": {"a": 1'])
def test_an_unfinished_start_is_neither_a_call_nor_rejected(text):
    calls = scan(text, NAMES)
    assert not any(c.closed for c in calls)
    assert TOOLS.parse(text) is None


def test_the_name_goes_out_once_the_arguments_open():
    stream = CallStream(NAMES)
    assert stream.feed('{"name": "add", "arguments": ') == [] and not stream.started
    first, rest = stream.feed('{"a')
    assert first.function.name == "add" and rest.function.arguments == '{"a' and stream.started


def test_a_name_that_only_starts_like_a_tool_is_rejected():
    with pytest.raises(NotACall):
        scan('{"name": "addition"}', NAMES)
