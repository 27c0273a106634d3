"""POST /v1/chat/completions through HTTP with the official openai client."""

import json

import pytest

from tests.server.conftest import MODEL, sse_events

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_has_openai_shape(client, llm_engine):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    [choice] = r.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and choice.logprobs is None
    text = llm_engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert r.usage.prompt_tokens == len(llm_engine.tokenize(text)) and r.usage.completion_tokens == 6


def test_chat_stream_sequence_and_usage(server):
    body = {
        "messages": MESSAGES,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with server.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert set(chunks[0]["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    assert chunks[-2]["choices"][0]["delta"] == {} and chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_chat_stream_equals_non_stream_with_n(client):
    kw = dict(model=MODEL, messages=MESSAGES, n=3, max_tokens=8, temperature=1.0, seed=42)
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts, finish = ["", "", ""], [None] * 3
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode())
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0, logprobs=True)
    assert all(t.top_logprobs == [] for t in plain.choices[0].logprobs.content)


def test_max_completion_tokens_content_parts_and_roles(client):
    messages = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Name a color"}, {"type": "text", "text": "."}]},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3 and r.choices[0].finish_reason in ("length", "stop")


def test_chat_without_max_tokens_stops_by_itself(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say yes."}], temperature=0, stop=["\n", "."]
    )
    assert r.choices[0].finish_reason == "stop"
