"""Schema fuzzing with schemathesis: requests generated from the OpenAPI schema
the server publishes, against a live server on loopback. Every answer must be a
non-5xx whose status, content type, headers and body (each SSE event of a
stream included) conform to that schema.

Three kinds of cases per operation:
- the request examples the schema documents, sent as they are;
- positive cases: schema-valid bodies, generated alone or laid over one of the
  documented examples (so that optional fields such as ``stream``, ``n`` or
  ``logprobs`` get exercised, which a generator rarely adds by itself);
- negative cases: bodies that violate the schema.

Bounded: a fixed number of examples, derandomized (the same cases every run),
generation kept short (max_tokens and n capped, a 128-token context).
"""

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.reliability.conftest import make_engine
from tests.server.conftest import LiveServer, settings, wait_idle

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
GENERATION = {("POST", "/v1/completions"), ("POST", "/v1/chat/completions")}
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 30}  # per generation route
OTHER_EXAMPLES = 3  # per GET route, positive only: they take no input to break
MAX_TOKENS = 3  # what one generation may cost


@pytest.fixture(scope="module")
def fuzz_engine(default_engine):
    return make_engine(default_engine, num_blocks=96, max_model_len=128)


@pytest.fixture(scope="module")
def live(fuzz_engine):
    with LiveServer(settings(max_n=4, max_waiting=64, max_request_body_bytes=256 << 10), fuzz_engine) as s:
        yield s


@pytest.fixture(scope="module")
def schema(live):
    return schemathesis.openapi.from_url(f"{live.url}/openapi.json")


@pytest.fixture(scope="module")
def session():
    with requests.Session() as s:
        yield s


def cheap(body):
    """Keeps a body's generation short; values that are refused anyway stay as they are."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and MAX_TOKENS < v <= 10**6:
            body[key] = 1 + v % MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS  # chat's default is the rest of the context
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and 2 < n <= 4:
        body["n"] = 2
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 3 and not all(isinstance(t, int) for t in prompt):
        body["prompt"] = prompt[:3]  # at most three prompts per request
    return body


def documented_examples(schema, op) -> list[dict]:
    content = schema.raw_schema["paths"][op.path][op.method.lower()].get("requestBody", {}).get("content", {})
    return [e["value"] for e in content.get("application/json", {}).get("examples", {}).values()]


def operations(schema) -> list:
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in ops} >= GENERATION
    return ops


class Tally:
    def __init__(self):
        self.statuses: dict[int, int] = {}
        self.streams = 0

    def add(self, case, response) -> None:
        self.statuses[response.status_code] = self.statuses.get(response.status_code, 0) + 1
        content_type = response.headers.get("content-type") or [""]  # schemathesis: a list per header
        self.streams += content_type[0].startswith("text/event-stream")


def send(case, live, session, tally: Tally) -> None:
    case.body = cheap(case.body)
    response = case.call(base_url=live.url, session=session, timeout=60)
    tally.add(case, response)
    case.validate_response(response, checks=CHECKS)


def test_documented_examples(live, schema, session, fuzz_engine):
    tally = Tally()
    for op in operations(schema):
        for body in documented_examples(schema, op):
            send(op.Case(body=body, media_type="application/json"), live, session, tally)
    wait_idle(fuzz_engine)
    assert tally.statuses == {200: 7} and tally.streams == 2, vars(tally)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["positive", "negative"])
def test_schema_fuzz(live, schema, session, fuzz_engine, mode):
    tally = Tally()
    for op in operations(schema):
        generation = (op.method.upper(), op.path) in GENERATION
        examples = EXAMPLES[mode] if generation else OTHER_EXAMPLES * (mode is GenerationMode.POSITIVE)
        if not examples:
            continue
        # Positive bodies are laid over a documented example half of the time ({} is "alone").
        bases = [{}] + documented_examples(schema, op) if mode is GenerationMode.POSITIVE else [{}]

        @hsettings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=mode), base=st.sampled_from(bases) | st.just({}))
        def run(case, base):
            if base and isinstance(case.body, dict):
                case.body = {**base, **case.body}
            send(case, live, session, tally)

        run()
    wait_idle(fuzz_engine)
    assert not any(status >= 500 for status in tally.statuses)
    if mode is GenerationMode.POSITIVE:  # the fuzz reached the engine, streams included
        assert tally.statuses.get(200, 0) >= 20 and tally.streams >= 1, vars(tally)
    else:
        assert tally.statuses.get(400, 0) >= 20, vars(tally)
