"""A client that goes away aborts its engine requests; their KV blocks are freed at once."""

import httpx
import pytest

from tests.server.conftest import wait_idle

LONG = {"prompt": "Tell me a long story about a dragon.", "max_tokens": 900, "ignore_eos": True}


def aborted(server) -> float:
    labels = {"model_name": server.serving.model_names[0], "engine": "0", "finished_reason": "abort"}
    return server.serving.metrics.registry.get_sample_value("vllm:request_success_total", labels) or 0.0


def test_stream_disconnect_frees_blocks(server, llm_engine):
    total = llm_engine.kv_manager.pool.num_blocks
    before = aborted(server)
    with server.http() as http:
        for n in (1, 3):  # one choice, then several merged streams
            with http.stream("POST", "/v1/completions", json={**LONG, "n": n, "stream": True}) as r:
                lines = r.iter_lines()
                got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data: ")]
                assert got, "no chunk before the disconnect"
                assert llm_engine.kv_manager.num_free_blocks < total  # the request holds blocks now
            # Closing the response mid-stream drops the connection. 900 tokens would take
            # far longer than this wait: the blocks come back because the request was aborted.
            wait_idle(llm_engine, timeout=5)
    assert aborted(server) == before + 4


def test_non_stream_disconnect_frees_blocks(server, llm_engine):
    before = aborted(server)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 900, "ignore_eos": True}
    with server.http(timeout=httpx.Timeout(30, read=1.0)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=body)
    wait_idle(llm_engine, timeout=5)
    assert aborted(server) == before + 1
    assert not server.serving.live and server.serving.pending == 0
