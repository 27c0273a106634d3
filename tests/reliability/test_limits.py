"""Configurable limits: requests in flight (503 + Retry-After), the per-request
time limit (504 request_timeout; an error event in a stream), the body size
(413, by Content-Length or while a chunked body arrives)."""

import time

import httpx
import pytest

from tests.reliability.conftest import finish_reason, parse_sse, stream
from tests.server.conftest import LiveServer, settings, wait_idle

LONG = {"prompt": "Count to one thousand:", "max_tokens": 900, "ignore_eos": True}
SHORT = {"prompt": "Hi", "max_tokens": 2}


def test_a_request_past_the_time_limit_ends_with_a_clean_timeout(rel_engine):
    with LiveServer(settings(max_request_seconds=2.0), rel_engine) as live, live.http() as http:
        t0 = time.monotonic()
        status, events = stream(live.url, LONG)
        took = time.monotonic() - t0
        assert status == 200 and events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert error["code"] == "request_timeout" and error["type"] == "server_error"
        assert all("error" not in e for e in events[:-2]) and len(events) >= 3  # it streamed tokens first
        assert 2.0 <= took < 12.0
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **LONG})
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        wait_idle(rel_engine, timeout=5)  # aborted: its blocks are back
        r = http.post("/v1/completions", json=SHORT)  # a request within the limit is unaffected
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        metrics = http.get("/metrics").text
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="SmolLM2-135M-Instruct"} 2.0' in metrics


def test_requests_in_flight_beyond_the_limit_get_503(rel_engine):
    with LiveServer(settings(max_concurrent_requests=2), rel_engine) as live:
        with live.http() as a, live.http() as b, live.http() as c:
            with a.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as ra:
                lines_a = ra.iter_lines()
                next(line for line in lines_a if line)  # A is generating
                with b.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as rb:
                    lines_b = rb.iter_lines()
                    next(line for line in lines_b if line)
                    r = c.post("/v1/completions", json=SHORT)
                    assert r.status_code == 503 and r.headers["retry-after"] == "1"
                    assert r.json()["error"]["code"] == "too_many_requests"
                    assert c.get("/health").status_code == 200  # busy is not unhealthy
            wait_idle(rel_engine, timeout=5)  # A and B went away: aborted
            r = c.post("/v1/completions", json=SHORT)
            assert r.status_code == 200
            metrics = c.get("/metrics").text
    rejected = 'specserve_request_rejected_total{model_name="SmolLM2-135M-Instruct",reason="too_many_requests"} 1.0'
    assert rejected in metrics


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_413(rel_engine, chunked):
    limit = 4096
    body = b'{"prompt": "' + b"a" * (limit * 4) + b'", "max_tokens": 1}'
    with LiveServer(settings(max_request_body_bytes=limit), rel_engine) as live:
        content = iter([body[i : i + 1000] for i in range(0, len(body), 1000)]) if chunked else body
        headers = {"content-type": "application/json"}
        r = httpx.post(f"{live.url}/v1/completions", content=content, headers=headers, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = httpx.post(f"{live.url}/v1/completions", json=SHORT, timeout=30)
        assert r.status_code == 200


def test_limits_stream_well_formed_under_a_time_limit_with_n(rel_engine):
    """Several choices of one request all end at the deadline; one error event, then [DONE]."""
    with LiveServer(settings(max_request_seconds=1.0), rel_engine) as live:
        with httpx.Client(base_url=live.url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json={**LONG, "n": 3, "stream": True}) as r:
                events = parse_sse(r.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_timeout"
    assert sum("error" in e for e in events if isinstance(e, dict)) == 1
    assert finish_reason(events[:-2]) is None
