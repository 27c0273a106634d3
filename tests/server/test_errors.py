"""Every error answer: its status and OpenAI's error body. Bad input never gives a 500."""

import json

import openai
import pytest

from tests.server.conftest import MAX_MODEL_LEN, MODEL, LiveServer, settings, sse_events

BODY_LIMIT = 64 * 1024
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(llm_engine):
    with LiveServer(settings(max_request_body_bytes=BODY_LIMIT, max_n=4), llm_engine) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with server.http() as client:
        yield client


def assert_error(response, status: int, param=..., code=...) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("invalid_request_error" if status in (400, 413) else error["type"])
    if param is not ...:
        assert error["param"] == param
    if code is not ...:
        assert error["code"] == code
    return error


COMPLETION_400 = [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),  # prompt + max_tokens beyond max-model-len
    ({"n": 5}, "n"),  # above --max-n
    ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),  # token id outside the vocabulary
    ({"temperature": "hot"}, "temperature"),  # wrong types
    ({"max_tokens": "many"}, "max_tokens"),
    ({"n": 1.5}, "n"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"stop": [""]}, "stop"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"seed": 2**70}, "seed"),
    ({"top_k": 10**30}, "top_k"),  # would overflow an int64 tensor inside the engine step
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"suffix": "!"}, "suffix"),  # unsupported
    ({"best_of": 2}, "best_of"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": "all"}, "prompt_logprobs"),
]


@pytest.mark.parametrize("fields,param", COMPLETION_400, ids=[f"{p}-{i}" for i, (_, p) in enumerate(COMPLETION_400)])
def test_completion_invalid_values_are_400(http, fields, param):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}
    assert_error(http.post("/v1/completions", json=body), 400, param=param)


CHAT_400 = [
    ({"temperature": -1}, "temperature"),
    ({"max_completion_tokens": -1}, "max_tokens"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages.0.content",
    ),
    ({"messages": [{"role": "user", "content": "word " * (MAX_MODEL_LEN + 50)}], "max_tokens": None}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": ["f"]}]}]}, "messages.0.tool_calls"),
    ({"messages": [*MSG, {"role": "assistant", "tool_calls": [{"function": "f"}]}]}, "messages.1.tool_calls"),
    ({"logprobs": True, "top_logprobs": 21}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 9}, "n"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}}, "response_format"),
]


@pytest.mark.parametrize("fields,param", CHAT_400, ids=[f"{p}-{i}" for i, (_, p) in enumerate(CHAT_400)])
def test_chat_invalid_values_are_400(http, fields, param):
    body = {"model": MODEL, "messages": MSG, "max_tokens": 2, **fields}
    assert_error(http.post("/v1/chat/completions", json=body), 400, param=param)


def test_messages_of_bad_parts_say_what_is_wrong(http):
    """Each 400 names the fault itself: a text part that lacks its text, an empty stop string."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text"}]}]}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, param="messages.0.content", code="invalid_value")
    assert error["message"] == "messages.0.content.0 is a text part without its 'text'"
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "stop": ["a", ""]}
    assert assert_error(http.post("/v1/completions", json=body), 400, param="stop")["message"] == (
        "stop must not hold an empty string")


def test_malformed_json_is_400(http):
    r = http.post("/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"})
    assert_error(r, 400, code="invalid_json")
    assert_error(
        http.post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"}), 400
    )
    assert_error(
        http.post("/v1/completions", json={"max_tokens": 1}), 400, param="prompt", code="missing_required_parameter"
    )


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty", "top_p", "min_p"])
@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN"])
def test_non_finite_floats_are_400(http, field, value):
    """Python's JSON parser accepts these extensions; the engine must never see them."""
    body = f'{{"prompt": "Hi", "max_tokens": 1, "{field}": {value}}}'.encode()
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, param=field)


def test_unknown_model_is_404(http):
    assert_error(
        http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, param="model", code="model_not_found"
    )
    assert_error(
        http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": MSG}), 404, code="model_not_found"
    )


def test_unknown_route_and_method(http):
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_body_over_the_limit_is_413(http):
    big = {"prompt": "x" * BODY_LIMIT, "max_tokens": 1}
    assert_error(http.post("/v1/completions", json=big), 413, code="request_too_large")
    chunked = (b"x" * 1024 for _ in range(BODY_LIMIT // 1024 + 2))  # no Content-Length
    r = http.post("/v1/completions", content=chunked, headers={"content-type": "application/json"})
    assert_error(r, 413, code="request_too_large")


def test_openai_client_sees_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)


def test_best_of_equal_to_n_is_fine(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "n": 2, "best_of": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


@pytest.fixture
def failing_runner(llm_engine):
    """The runner raises from its second forward pass on: an engine failure mid-request."""
    runner = llm_engine.runner
    real, calls = runner.execute, []

    def execute(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    runner.execute = execute
    yield
    del runner.execute


def test_engine_failure_mid_stream_is_an_error_event(http, failing_runner):
    body = {"prompt": "Hello", "max_tokens": 20, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert json.loads(events[0])["choices"][0]["text"]  # the first token came through


def test_engine_failure_without_stream_is_500_with_body(http, failing_runner):
    r = http.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 20})
    error = assert_error(r, 500, code="engine_error")
    assert error["type"] == "server_error"
