"""Faults seen through HTTP: an exception while processing one request fails that
request alone, with a clean error event in its stream; a failing drafter only
makes its requests decode plainly for that step (counted in /metrics); an engine
thread that dies turns /health and every generation route into 503s, and the
streams in flight end with an error event instead of hanging.

Faults are injected with the engine's test hook (``engine.utils.faults``). A request is
picked out by its seed: the hook looks up the ids it is given in the scheduler.
"""

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.faults import InjectedFault
from tests.reliability.conftest import finish_reason, in_threads, make_engine, stream, stream_text
from tests.server.conftest import LiveServer, settings, wait_idle

POISON = 666_666  # the seed that marks the request to fail
PROMPT = "List the planets of the solar system, one per line:\n1. Mercury\n2. Venus\n3."
GOOD = [
    {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
]
BAD = {"prompt": "Tell me a story.", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "seed": POISON}


def poisoned(engine, stage: str, error: type[BaseException] = InjectedFault):
    """A fault hook failing ``stage`` for the requests that carry the POISON seed."""

    def hook(at: str, request_ids: list[str]) -> None:
        requests = engine.scheduler.requests
        if at == stage and any(rid in requests and requests[rid].params.seed == POISON for rid in request_ids):
            raise error(f"injected {stage} fault")

    return hook


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def run_batch(url: str, bodies: list[dict]) -> list:
    return in_threads(stream, [(url, b) for b in bodies])


@pytest.mark.parametrize("stage", ["model", "sampler"])
def test_a_failing_request_gets_an_error_event_and_the_others_finish(rel_engine, stage):
    with LiveServer(settings(), rel_engine) as live:
        want = [stream_text(events) for _, events in run_batch(live.url, GOOD)]
        rel_engine.set_fault_hook(poisoned(rel_engine, stage))
        try:
            results = run_batch(live.url, [GOOD[0], BAD, GOOD[1]])
            status, non_stream = 0, None
            with live.http() as http:
                r = http.post("/v1/completions", json=BAD)
                status, non_stream = r.status_code, r.json()
        finally:
            rel_engine.set_fault_hook(None)
        (s0, good0), (s1, bad), (s2, good1) = results
        assert s0 == s1 == s2 == 200
        # The failing stream: an error event (OpenAI's body), then [DONE]; nothing after.
        assert bad[-1] == "[DONE]"
        error = bad[-2]["error"]
        assert (
            error["code"] == "engine_error" and error["type"] == "server_error" and "InjectedFault" in error["message"]
        )
        assert all("error" not in e for e in bad[:-2])
        # The others: unaffected, the same text as without the fault.
        for events, text in ((good0, want[0]), (good1, want[1])):
            assert events[-1] == "[DONE]" and finish_reason(events) == "length"
            assert stream_text(events) == text
        # Without streaming: a 500 with the error body.
        assert status == 500 and non_stream["error"]["code"] == "engine_error"
        assert metric(live.url, "vllm:request_success_total", finished_reason="error") >= 2
        wait_idle(rel_engine)


def test_a_failing_drafter_falls_back_to_plain_decoding_and_is_counted(ngram_engine, rel_engine):
    with LiveServer(settings(), rel_engine) as plain:
        want = [stream_text(events) for _, events in run_batch(plain.url, [*GOOD, BAD])]
    with LiveServer(settings(), ngram_engine) as live:
        before = metric(live.url, "specserve_spec_decode_fallbacks_total")
        ngram_engine.set_fault_hook(poisoned(ngram_engine, "drafter"))
        try:
            results = run_batch(live.url, [*GOOD, BAD])
        finally:
            ngram_engine.set_fault_hook(None)
        for (status, events), text in zip(results, want, strict=True):
            assert status == 200 and events[-1] == "[DONE]" and finish_reason(events) == "length"
            assert stream_text(events) == text  # exact: a fallback step decodes plainly
        assert metric(live.url, "specserve_spec_decode_fallbacks_total") > before
        assert metric(live.url, "vllm:request_success_total", finished_reason="error") == 0


class EngineKilled(BaseException):
    """Not an Exception: escapes the engine's per-request isolation and ends the engine loop."""


def test_a_dead_engine_thread_is_unhealthy_and_refuses_with_503(default_engine):
    engine = make_engine(default_engine, num_blocks=64)
    with LiveServer(settings(), engine) as live, live.http(timeout=30) as http:
        assert http.get("/health").status_code == 200

        def long_stream():
            body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True}
            return stream(live.url, body, timeout=30)

        def killer():
            deadline = time.monotonic() + 30
            while not any(r.num_output_tokens for r in list(engine.scheduler.running)):  # the long one streams
                assert time.monotonic() < deadline, "the long request did not start"
                time.sleep(0.02)
            engine.set_fault_hook(poisoned(engine, "model", EngineKilled))
            return stream(live.url, BAD, timeout=30)

        (s_long, long_events), (s_bad, bad_events) = in_threads(lambda f: f(), [(long_stream,), (killer,)])
        # Both streams in flight end promptly with an error event and [DONE], not a hang.
        for status, events in ((s_long, long_events), (s_bad, bad_events)):
            assert status == 200 and events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "engine_dead" and events[-2]["error"]["type"] == "server_error"
        assert isinstance(live.serving.engine.dead_error, EngineKilled)
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        for path, body in (
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}),
        ):
            r = http.post(path, json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        engine.set_fault_hook(None)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks
    assert not engine.has_unfinished()
