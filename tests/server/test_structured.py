"""Structured outputs and tools over HTTP on the default model: ``response_format``
(``json_object``, ``json_schema``), vLLM's ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar`` (EBNF and Lark), and ``tools`` with ``tool_choice``, with speculation off,
with prompt lookup (ngram) and with a model drafter (early exit).

Sampled requests (temperature 1) against five JSON schemas must all parse and
validate (``jsonschema``): a few per drafter in the default suite (speculation off and
prompt lookup; early exit's server runs under ``slow``), 100 per drafter under the ``slow`` marker.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from server.tools import Tools
from tests.server.conftest import MAX_MODEL_LEN, MODEL, NUM_BLOCKS, LiveServer, settings, sse_events, wait_idle

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "is_question": {"type": "boolean"},
            "score": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["sentiment", "is_question", "score"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "city": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 20}, "country": {"type": "string", "maxLength": 20}},
                "required": ["name", "country"],
            },
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        },
        "required": ["city", "population"],
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "priority": {"enum": [1, 2, 3]},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 16}]},
        },
        "required": ["code", "priority", "note"],
    },
]
PROMPTS = [
    "Describe a person as JSON.",
    "Is 'I love this!' positive? Answer in JSON.",
    "Give tags for a blog post about cooking, as JSON.",
    "Describe a city as JSON.",
    "Make a support ticket as JSON.",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                           "b": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["a", "b"],
        },
    },
}
SPEC = {
    "off": None,
    "ngram": dict(method="ngram", num_speculative_tokens=3, adaptive=False, verify_cost=0.1),
    "early_exit": dict(method="early_exit", num_speculative_tokens=3, adaptive=False, verify_cost=0.1),
}


# The model drafter's server runs under slow (its grammar-masked drafts are checked by
# distribution in the default suite: tests/spec/test_grammar_distribution.py).
@pytest.fixture(scope="module", params=["off", "ngram", pytest.param("early_exit", marks=pytest.mark.slow)])
def spec_server(request, default_engine):
    spec = SPEC[request.param]
    config = EngineConfig(
        ModelConfig(max_model_len=MAX_MODEL_LEN),
        CacheConfig(num_blocks=NUM_BLOCKS),
        SchedulerConfig(),
        SpeculativeConfig(**spec) if spec else SpeculativeConfig(),
    )
    engine = LLMEngine(config, model=default_engine.model, tokenizer=default_engine.tokenizer)
    with LiveServer(settings(), engine) as server:
        yield request.param, server
    wait_idle(engine)


def schema_request(i: int, seed: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[i % 5]}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": f"s{i % 5}", "schema": SCHEMAS[i % 5], "strict": True}},
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": 120,
    }


def run_schema_requests(server, num_requests: int) -> list[str]:
    """``num_requests`` sampled chat requests, round-robin over the schemas, sent at once;
    asserts that every answer parses, validates and finished with "stop"."""
    with server.http(timeout=1800) as http, ThreadPoolExecutor(16) as pool:
        requests = [schema_request(i, 1000 + i) for i in range(num_requests)]
        responses = list(pool.map(lambda body: http.post("/v1/chat/completions", json=body), requests))
    texts = []
    for i, r in enumerate(responses):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"]
        jsonschema.validate(json.loads(text), SCHEMAS[i % 5])
        assert choice["finish_reason"] == "stop", (i, text)
        texts.append(text)
    return texts


def test_sampled_answers_follow_their_schemas(spec_server):
    name, server = spec_server
    texts = run_schema_requests(server, 5)
    assert len(set(texts)) > 1
    if name != "off":
        assert server.engine.speculator.policy is not None


@pytest.mark.slow
def test_100_sampled_answers_follow_their_schemas(spec_server):
    run_schema_requests(spec_server[1], 100)


def test_guided_extras_on_completions(spec_server):
    _, server = spec_server
    with server.http() as http:
        body = {"model": MODEL, "prompt": "The answer is", "max_tokens": 20, "temperature": 1.0, "seed": 3}
        r = http.post("/v1/completions", json={**body, "guided_choice": ["yes", "no", "maybe so"]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in ("yes", "no", "maybe so")
        assert r.json()["choices"][0]["finish_reason"] == "stop"
        r = http.post("/v1/completions", json={**body, "guided_regex": r"[0-9]{3}-[a-z]{2,4}"})
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", r.json()["choices"][0]["text"]), r.json()
        r = http.post("/v1/completions", json={**body, "max_tokens": 60, "guided_json": json.dumps(SCHEMAS[0])})
        jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), SCHEMAS[0])
        for grammar, pattern in GRAMMARS:
            r = http.post("/v1/completions", json={**body, "guided_grammar": grammar})
            choice = r.json()["choices"][0]
            assert re.fullmatch(pattern, choice["text"]) and choice["finish_reason"] == "stop", (grammar, choice)


# guided_grammar in both languages xgrammar reads, and what the output must then match.
GRAMMARS = [
    ('root ::= ("yes" | "no") ", " digit digit\ndigit ::= [0-9]', r"(yes|no), [0-9]{2}"),
    ('start: WORD "-" NUM\nWORD: /[a-z]{2,5}/\nNUM: /[0-9]{3}/', r"[a-z]{2,5}-[0-9]{3}"),
]


def test_json_object_and_guided_json_on_chat(spec_server):
    _, server = spec_server
    with server.http() as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "A JSON object about a cat."}], "temperature": 0}
        r = http.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}, "max_tokens": 40})
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:  # cut by max_tokens: still the start of an object
            assert choice["message"]["content"].startswith("{")
        r = http.post("/v1/chat/completions", json={**body, "guided_json": SCHEMAS[1], "max_tokens": 60})
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), SCHEMAS[1])


def test_named_tool_choice_returns_a_parsed_call(spec_server):
    _, server = spec_server
    client = server.client()
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=80,
        temperature=1.0,
        seed=5,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_required_tool_choice_streams_the_call_piece_by_piece(spec_server):
    """OpenAI's delta shape: the call's id, type and name first, then its arguments'
    text in pieces; the openai SDK assembles the same call as the unstreamed answer."""
    _, server = spec_server
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Add 2 and 3."}],
        "tools": [WEATHER, ADD],
        "tool_choice": "required",
        "max_tokens": 80,
        "seed": 2,
    }
    with server.http() as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"][0]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert not any("content" in d for d in deltas[1:]), deltas  # the call is never streamed as text
    pieces = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert all(len(p) == 1 for p in pieces)
    first, *rest = [p[0] for p in pieces]
    assert first == {"index": 0, "id": first["id"], "type": "function",
                     "function": {"name": whole["function"]["name"], "arguments": ""}}
    assert first["id"].startswith("call_") and len(rest) >= 3, pieces
    assert all(p.keys() == {"index", "function"} and p["function"].keys() == {"arguments"} for p in rest)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    (call,) = state.get_final_completion().choices[0].message.tool_calls
    assert call.function.name == whole["function"]["name"]
    assert json.loads(call.function.arguments) == json.loads(whole["function"]["arguments"])
    fn = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]
    jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])


def test_a_streamed_call_carries_every_tokens_logprob(spec_server):
    """Tokens that add no piece to a call (its closing braces) still send their logprobs: the
    stream's are the unstreamed answer's, one per completion token."""
    _, server = spec_server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER, ADD],
            "tool_choice": "required", "max_tokens": 60, "temperature": 1.0, "logprobs": True, "top_logprobs": 1}
    with server.http() as http:
        for seed in range(2):
            whole = http.post("/v1/chat/completions", json={**body, "seed": seed}).json()
            streamed = {**body, "seed": seed, "stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/chat/completions", json=streamed) as r:
                chunks = [json.loads(e) for e in sse_events(r)[:-1]]
            tokens = [t for c in chunks for ch in c["choices"] for t in ((ch.get("logprobs") or {}).get("content") or [])]
            assert tokens == whole["choices"][0]["logprobs"]["content"], seed
            assert len(tokens) == chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_auto_tool_choice_answers_text_or_a_call(spec_server):
    _, server = spec_server
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], tools=[WEATHER], max_tokens=20, temperature=0
    )
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


# ---- without the model ----

TOOLS = Tools((WEATHER["function"], ADD["function"]), "auto")


@pytest.mark.parametrize(
    "text,names",
    [
        ('{"name": "add", "arguments": {"a": 1, "b": 2}}', ["add"]),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', ["get_weather"]),
        ('[{"name": "add", "arguments": {}}, {"name": "add", "arguments": {"a": 1}}]', ["add", "add"]),
        ('{"name": "unknown", "arguments": {}}', None),
        ('{"name": "add", "arguments": "1, 2"}', None),
        ("The weather is fine.", None),
        ('{"name": "add", "arguments": {"a": 1}', None),
        ('{"name": "add", "arguments": {"a": 1}} I called add.', ["add"]),  # text after a call is ignored
    ],
)
def test_tool_call_format_is_parsed(text, names):
    calls = TOOLS.parse(text)
    assert (None if calls is None else [c.function.name for c in calls]) == names
    if calls:
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)


BAD_GRAMMARS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/defs/missing"}}}},
     "response_format", "defs"),
    ({"response_format": {"type": "xml"}}, "response_format", "xml"),
    ({"guided_regex": "a(b"}, "guided_regex", "parenthesis"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"guided_grammar": "root ::= digit"}, "guided_grammar", "not defined"),
    ({"guided_grammar": "start: WORD\n"}, "guided_grammar", "WORD"),
    ({"guided_grammar": "yes or no"}, "guided_grammar", "grammar"),
    ({"guided_grammar": " "}, "guided_grammar", "empty"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
]


@pytest.mark.parametrize("fields,param,named", BAD_GRAMMARS, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD_GRAMMARS)])
def test_invalid_grammar_is_a_400_that_names_the_problem(server, fields, param, named):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **fields}
    with server.http() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and named in error["message"], error
