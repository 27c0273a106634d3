"""POST /v1/completions through HTTP with the official openai client."""

import json

import pytest

from tests.server.conftest import MODEL, sse_events

PROMPT = "The capital of France is"


def test_completion_has_openai_shape(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert isinstance(r.created, int)
    [choice] = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert choice.text.startswith(" Paris")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 5 and r.usage.total_tokens == 10


def test_raw_body_has_exactly_openai_fields(server):
    with server.http() as http:
        body = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0}).json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert set(body["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


def test_prompt_shapes_give_the_same_greedy_text(client, llm_engine):
    ids = llm_engine.tokenize(PROMPT)
    other = "Once upon a time"
    as_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0).choices[0].text
    assert as_ids == as_text
    r = client.completions.create(model=MODEL, prompt=[PROMPT, other], max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == as_text
    assert r.usage.prompt_tokens == len(ids) + len(llm_engine.tokenize(other))
    r2 = client.completions.create(model=MODEL, prompt=[ids, llm_engine.tokenize(other)], max_tokens=4, temperature=0)
    assert [c.text for c in r2.choices] == [c.text for c in r.choices]


def test_n_choices_per_prompt_in_openai_order(client):
    r = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], n=2, max_tokens=3, temperature=1.0, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason in ("length", "stop") for c in r.choices)
    assert 4 <= r.usage.completion_tokens <= 12


def test_stream_equals_non_stream_for_the_same_seed(client):
    kw = dict(model=MODEL, prompt=PROMPT, n=2, max_tokens=8, temperature=0.9, seed=1234)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    texts = ["", ""]
    finish = [None, None]
    for chunk in chunks[:-1]:
        assert chunk.usage is None and chunk.id == chunks[0].id and chunk.object == "text_completion"
        for c in chunk.choices:
            texts[c.index] += c.text
            finish[c.index] = c.finish_reason or finish[c.index]
    assert texts == [c.text for c in whole.choices]
    assert finish == [c.finish_reason for c in whole.choices]
    last = chunks[-1]
    assert last.choices == [] and last.usage == whole.usage


def test_stream_ends_with_done_and_has_no_usage_unless_asked(server):
    with server.http() as http:
        with http.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_prepends_the_prompt(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT) and len(r.choices[0].text) > len(PROMPT)
    streamed = "".join(
        c.text
        for ch in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, stream=True
        )
        for c in ch.choices
    )
    assert streamed == r.choices[0].text


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for tok, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and len(top) >= 2 and tok in top
        assert max(top.values()) == pytest.approx(value, abs=1e-4)  # greedy: the sampled token is the best
    streamed = [
        c.choices[0].logprobs
        for c in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, stream=True
        )
        if c.choices
    ]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


def test_stop_string_ends_the_choice(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stop=["."])
    assert r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text


def test_sampling_fields_are_accepted(client):
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"7042": -100},
        user="someone",
        seed=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert r.choices[0].finish_reason == "length"
    greedy = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={"7042": -100}
    )
    assert not greedy.choices[0].text.startswith(" Paris")  # 7042 is " Paris"
