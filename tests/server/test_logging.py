"""Request ids: returned in X-Request-Id, carried by every log line of the request;
no prompt or output text in the logs."""

import io
import json
import logging

import pytest

from server.logs import JsonFormatter, RequestIdFilter
from tests.server.conftest import MODEL

SECRET_PROMPT = "My password is hunter2"


@pytest.fixture
def json_log():
    """Captures the server's log lines as JSON objects."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RequestIdFilter())
    loggers = [logging.getLogger(n) for n in ("server", "specserve.access", "api")]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    yield lambda: [json.loads(line) for line in buffer.getvalue().splitlines()]
    for lg in loggers:
        lg.removeHandler(handler)


def test_request_id_header_and_log_lines(server, json_log):
    with server.http() as http:
        r = http.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": SECRET_PROMPT, "max_tokens": 3},
            headers={"X-Request-Id": "req-42"},
        )
        assert r.status_code == 200 and r.headers["x-request-id"] == "req-42"
        generated = http.get("/health").headers["x-request-id"]
        assert len(generated) == 32 and generated != "req-42"
        assert http.get("/health", headers={"X-Request-Id": "bad id\\n"}).headers["x-request-id"] != "bad id\\n"
    lines = json_log()
    mine = [line for line in lines if line["request_id"] == "req-42"]
    assert {line["msg"] for line in mine} == {"generation done", "http request"}
    done = next(line for line in mine if line["msg"] == "generation done")
    assert done["completion_tokens"] == 3 and done["finish_reasons"] == ["length"] and done["id"].startswith("cmpl-")
    access = next(line for line in mine if line["msg"] == "http request")
    assert access["status"] == 200 and access["path"] == "/v1/completions"
    text = json.dumps(lines)
    assert "hunter2" not in text
