"""Hostile input: every case gets a 4xx with OpenAI's error body (never a 5xx,
never a hang) and the server keeps serving afterwards."""

import json
import time

import httpx
import pytest

from tests.reliability.conftest import finish_reason, in_threads, stream
from tests.server.conftest import MAX_MODEL_LEN, LiveServer, settings, wait_idle

BODY_LIMIT = 1 << 20
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def live(rel_engine):
    with LiveServer(settings(max_request_body_bytes=BODY_LIMIT, max_n=8), rel_engine) as s:
        yield s


@pytest.fixture
def http(live, rel_engine):
    with live.http(timeout=30) as client:
        yield client
    with live.http(timeout=30) as client:  # still serving after each case
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
    wait_idle(rel_engine)


def assert_4xx(r: httpx.Response, status: int = 400, param=...) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not ...:
        assert error["param"] == param
    return error


def vocab(live) -> int:
    return live.serving.engine.engine.model.config.vocab_size


def test_max_tokens_above_the_context_left_is_refused_as_vllm_does(http):
    """Room for exactly max_tokens is served; one more is a 400 whose message gives vLLM's
    numbers: max_tokens, the context length, the input tokens."""
    prompt = [1] * (MAX_MODEL_LEN - 2)
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text[:300]
    error = assert_4xx(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3}), param="max_tokens")
    assert error["message"] == (f"max_tokens is too large: 3. This model's maximum context length is {MAX_MODEL_LEN} "
                                f"tokens and your request has {MAX_MODEL_LEN - 2} input tokens "
                                f"(3 > {MAX_MODEL_LEN} - {MAX_MODEL_LEN - 2})")
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": MAX_MODEL_LEN})
    assert f"is too large: {MAX_MODEL_LEN}. This model's maximum context length" in assert_4xx(r)["message"]


def test_prompt_token_ids_outside_the_vocabulary(live, http):
    v = vocab(live)
    for prompt in ([-1], [v], [1, 2, v + 5], [2**63 - 1], [[1, 2], [v]], [[-5]]):
        assert_4xx(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}), param="prompt")
    for prompt in ([2**63], [-(2**63) - 1], [1.5], [True, 2]):  # not int64, not ints
        assert_4xx(http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}))
    r = http.post("/v1/completions", json={"prompt": [v - 1, 0], "max_tokens": 1})  # the edges are fine
    assert r.status_code == 200


@pytest.mark.parametrize("value", [MAX_MODEL_LEN, 10**9, 2**63 - 1, 2**63, 10**30, -1])
def test_huge_max_tokens(http, value):
    assert_4xx(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": value}), param="max_tokens")
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": value})
    assert_4xx(r, param="max_completion_tokens" if value >= 2**63 else "max_tokens")


@pytest.mark.parametrize("value", [9, 10**6, 2**63 - 1, 2**64, -(2**63)])
def test_huge_n(http, value):
    assert_4xx(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "n": value}), param="n")
    assert_4xx(http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "n": value}), param="n")


def test_many_prompts_times_n_beyond_the_queue(http):
    r = http.post("/v1/completions", json={"prompt": ["Hi"] * 200, "max_tokens": 1, "n": 8})
    assert_4xx(r, param="n")


@pytest.mark.parametrize("depth", [100, 5_000, 300_000])
def test_deeply_nested_json(http, depth):
    arrays = "[" * depth + "]" * depth
    objects = '{"a":' * depth + "1" + "}" * depth
    for body in (
        arrays,
        '{"prompt": ' + arrays + ', "max_tokens": 1}',
        '{"prompt": "Hi", "max_tokens": 1, "user": ' + objects + "}",
        '{"messages": [{"role": "user", "content": ' + arrays + "}]}",
    ):
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500 and r.status_code != 422, r.text[:300]
        assert r.json()["error"]["message"]


def test_huge_json(http):
    big = json.dumps({"prompt": "word " * (BODY_LIMIT // 4), "max_tokens": 1})
    assert_4xx(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
    many = json.dumps({"prompt": "Hi", "max_tokens": 1, "stop": ["x"] * (BODY_LIMIT // 4)})
    assert_4xx(http.post("/v1/completions", content=many, headers={"content-type": "application/json"}), 413)
    # Just under the limit: a prompt far longer than the context is a 400, found fast.
    long = json.dumps({"prompt": "word " * (BODY_LIMIT // 6), "max_tokens": 1})
    t0 = time.monotonic()
    assert_4xx(http.post("/v1/completions", content=long, headers={"content-type": "application/json"}), 400)
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "\xff\xfe\xfd", "max_tokens": 1}',  # not UTF-8
        b'{"prompt": "caf\xe9", "max_tokens": 1}',  # Latin-1
        b"\xff\xfe\x00\x00garbage",
        b'{"prompt": "Hi", "max_tokens": 1}\xff',
        b"\x00" * 64,
        b'{"prompt": "Hi\x00there", "max_tokens": 1}',  # a raw NUL inside a string (invalid JSON)
    ],
)
def test_non_utf8_and_binary_bodies(http, body):
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_4xx(r)


@pytest.mark.parametrize(
    "text",
    ["\ud800", "a\udfffb", "\ud83d", "\x00\x01\x02", "\u202e\ufeff", "\U0010ffff", "\ufffd" * 50],
    ids=["lone-high", "lone-low", "half-pair", "controls", "bidi-bom", "max-codepoint", "replacement"],
)
def test_odd_unicode_in_every_text_field(http, text):
    """JSON escapes can carry lone surrogates, which are not valid UTF-8: a 400;
    other odd characters are text like any other."""
    bodies = [
        ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        ("/v1/completions", {"prompt": ["Hi", text], "max_tokens": 1}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stop": [text]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}], "max_tokens": 1},
        ),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "model": text}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "user": text}),
    ]
    surrogate = any(0xD800 <= ord(c) <= 0xDFFF for c in text)
    for path, body in bodies:
        r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        if "model" in body:
            assert r.status_code == (400 if surrogate else 404), r.text[:300]
        elif surrogate and "user" not in body:
            assert_4xx(r)
        else:
            assert r.status_code in (200, 400), r.text[:300]


def test_hundreds_of_stop_strings(http):
    stops = [f"never-{i}-{'x' * (i % 40)}" for i in range(500)]
    t0 = time.monotonic()
    r = http.post(
        "/v1/completions", json={"prompt": "Count: 1, 2, 3,", "max_tokens": 8, "temperature": 0, "stop": stops}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    # One that matches, among the hundreds: the output stops there.
    plain = http.post("/v1/completions", json={"prompt": "Count: 1, 2, 3,", "max_tokens": 8, "temperature": 0}).json()
    word = plain["choices"][0]["text"].strip().split()[0]
    r = http.post(
        "/v1/completions",
        json={"prompt": "Count: 1, 2, 3,", "max_tokens": 8, "temperature": 0, "stop": [*stops, word]},
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and word not in choice["text"]
    status, events = stream(http.base_url.__str__().rstrip("/"), {"prompt": "Hi", "max_tokens": 4, "stop": stops * 4})
    assert status == 200 and events[-1] == "[DONE]" and finish_reason(events)
    assert time.monotonic() - t0 < 30
    assert_4xx(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "stop": [*stops, ""]}), param="stop")


@pytest.mark.parametrize(
    "bias",
    [
        {"x": 1},
        {"-1": 1},
        {"1.5": 1},
        {" 12": 1},
        {"1_0": 1},
        {"\u0661\u0662": 1},  # Arabic-Indic digits: Python's int() takes them
        {"": 1},
        {"99999999999": 1},  # beyond the vocabulary
        {str(2**70): 1},
        {"5": 1000},
        {"5": "high"},
        {"5": None},
    ],
    ids=lambda b: repr(b)[:24],
)
def test_logit_bias_with_invalid_keys_or_values(http, bias):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logit_bias": bias})
    assert_4xx(r, param="logit_bias")


def test_logit_bias_nan_and_infinity(http):
    for raw in ('{"5": NaN}', '{"5": Infinity}', '{"5": 1e400}'):
        body = '{"prompt": "Hi", "max_tokens": 1, "logit_bias": ' + raw + "}"
        assert_4xx(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}))


def test_vocabulary_edge_in_logit_bias_is_fine(live, http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "logit_bias": {str(vocab(live) - 1): 5}})
    assert r.status_code == 200


def test_concurrent_aborts_of_the_same_request(live, http, rel_engine):
    """One generation aborted at once by its client's disconnect, the drain deadline,
    the time limit and a second close, from the event loop and from other threads:
    it ends once, is counted once, and frees everything."""
    serving = live.serving
    body = {"prompt": "Count to one thousand:", "max_tokens": 900, "ignore_eos": True, "stream": True}
    before = serving.metrics.registry.get_sample_value(
        "vllm:request_success_total", {"model_name": serving.model_names[0], "engine": "0", "finished_reason": "abort"}
    )
    with live.http(timeout=30) as client, client.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(line for line in lines if line)
        [gen] = list(serving.live.values())
        loop = gen._tasks[0].get_loop()  # the server's event loop

        def hit(i):
            if i % 3 == 0:
                loop.call_soon_threadsafe(gen.abort, "timeout")
            elif i % 3 == 1:
                loop.call_soon_threadsafe(serving.abort_all, "shutdown")
            else:
                loop.call_soon_threadsafe(gen.close, "disconnect")
            serving.engine.abort(gen.choices[0].engine_id)

        in_threads(hit, [(i,) for i in range(24)])
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    wait_idle(rel_engine, timeout=10)
    after = serving.metrics.registry.get_sample_value(
        "vllm:request_success_total", {"model_name": serving.model_names[0], "engine": "0", "finished_reason": "abort"}
    )
    assert after == before + 1 and not serving.live and serving.pending == 0
