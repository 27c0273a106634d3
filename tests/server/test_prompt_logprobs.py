"""Prompt log-probabilities over HTTP: ``echo`` with ``logprobs`` (OpenAI's legacy
shape, ``max_tokens: 0`` included, as lm-evaluation-harness sends them) and
vLLM's ``prompt_logprobs`` on completions and chat. Their values are the
engine's (tests/engine_core/test_prompt_logprobs.py checks those against
transformers); here: shapes, and that every route reports the same numbers."""

import json

import pytest

from tests.server.conftest import MODEL, sse_events

PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def ids(llm_engine) -> list[int]:
    return llm_engine.tokenize(PROMPT)


def post(server, path: str, **body) -> dict:
    with server.http() as http:
        r = http.post(path, json={"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_logprobs_max_tokens_0_scores_the_prompt(server, ids, default_tokenizer):
    body = post(server, "/v1/completions", prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, prompt_logprobs=2)
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp = choice["logprobs"]
    assert lp["tokens"] == [default_tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(ids)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    for tok, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert value < 0 and top[tok] == value and 2 <= len(top) <= 3
        assert max(top.values()) >= value
    # vLLM's shape, same request: None first, then {token id: {logprob, rank, decoded_token}}.
    vllm = choice["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == len(ids)
    for i, entry in enumerate(vllm[1:], 1):
        mine = entry[str(ids[i])]
        assert mine["logprob"] == lp["token_logprobs"][i] and mine["decoded_token"] == lp["tokens"][i]
        assert 2 <= len(entry) <= 3 and {1, 2} <= {e["rank"] for e in entry.values()}
        likelier = sum(e["logprob"] > mine["logprob"] for e in entry.values())
        assert mine["rank"] == 1 + likelier if mine["rank"] <= 2 else likelier == 2  # in the top 2, or past it


def test_echo_logprobs_then_generated_tokens(server, ids):
    plain = post(server, "/v1/completions", prompt=PROMPT, logprobs=1, max_tokens=3)["choices"][0]
    echoed = post(server, "/v1/completions", prompt=PROMPT, echo=True, logprobs=1, max_tokens=3)["choices"][0]
    scored = post(server, "/v1/completions", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    lp, head, tail = echoed["logprobs"], scored["logprobs"], plain["logprobs"]
    p = len(ids)
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        assert lp[key] == head[key] + tail[key]
    prompt_chars = sum(len(t) for t in head["tokens"])
    assert lp["text_offset"] == head["text_offset"] + [prompt_chars + o for o in tail["text_offset"]]
    assert len(lp["tokens"]) == p + 3


def test_streamed_echo_logprobs_equal_the_whole_response(server):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 4}
    whole = post(server, "/v1/completions", **body)["choices"][0]
    with server.http() as http:
        with http.stream("POST", "/v1/completions", json={"model": MODEL, "temperature": 0, "stream": True, **body}) as r:
            events = sse_events(r)
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [v for c in chunks for v in c["logprobs"][key]] == whole["logprobs"][key]


def test_lm_eval_loglikelihood_request(server, llm_engine):
    """lm-evaluation-harness's local-completions: token-id prompts in a batch, echo,
    logprobs 1, max_tokens 1; it reads token_logprobs[ctxlen:-1] of each choice."""
    context, continuation = llm_engine.tokenize("Paris is the capital of"), llm_engine.tokenize(" France")
    prompts = [context + continuation, context]
    body = post(server, "/v1/completions", prompt=prompts, echo=True, logprobs=1, max_tokens=1, seed=1234)
    first, second = body["choices"]
    assert len(first["logprobs"]["token_logprobs"]) == len(prompts[0]) + 1
    assert len(second["logprobs"]["token_logprobs"]) == len(prompts[1]) + 1
    ll = first["logprobs"]["token_logprobs"][len(context) : -1]
    assert len(ll) == len(continuation) and all(v < 0 for v in ll)
    assert first["logprobs"]["token_logprobs"][: len(context)] == second["logprobs"]["token_logprobs"][: len(context)]


def test_prompt_logprobs_on_completions_with_n(server, ids):
    body = post(server, "/v1/completions", prompt=ids, n=2, max_tokens=2, prompt_logprobs=0, temperature=1.0, seed=3)
    a, b = body["choices"]
    assert a["logprobs"] is None and a["prompt_logprobs"] == b["prompt_logprobs"]
    assert a["prompt_logprobs"][0] is None
    assert [list(e) for e in a["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]


def test_prompt_logprobs_on_chat(server, llm_engine):
    messages = [{"role": "user", "content": "Name a colour."}]
    body = post(server, "/v1/chat/completions", messages=messages, max_tokens=2, prompt_logprobs=1)
    scored = post(server, "/v1/completions", prompt=llm_engine.tokenize(
        llm_engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ), max_tokens=0, prompt_logprobs=1)
    assert body["prompt_logprobs"] == scored["choices"][0]["prompt_logprobs"]
    assert set(body) == {"id", "object", "created", "model", "choices", "usage", "prompt_logprobs"}
    plain = post(server, "/v1/chat/completions", messages=messages, max_tokens=2)
    assert "prompt_logprobs" not in plain


def test_max_tokens_0_without_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert r.choices[0].text == "" and r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0
