"""The load test, short: 40 streamed requests at concurrency 8 against two live
servers (plain, and n-gram speculation with per-request opt-outs), 10% of
clients hanging up mid-stream and 10% sending invalid parameters. The full run
is ``python -m bench.load`` (300 requests at concurrency 32, three drafters).

Checks: no 5xx; every completed stream well formed with consistent usage;
every invalid request a 4xx with the error body; every greedy request's text
equal to its text alone; afterwards the block pool back to its initial free
count, no per-request state left anywhere, and resident memory within a few
percent of before."""

import asyncio

import psutil
import pytest

from bench.load import RSS_TOLERANCE, ServerRun, check_run, engine_idle
from bench.loadgen import make_plan, run_alone, run_load
from tests.reliability.conftest import leftover_state
from tests.server.conftest import LiveServer, settings, wait_idle

REQUESTS, CONCURRENCY, MAX_TOKENS = 40, 8, (2, 8)


@pytest.fixture(params=["rel_engine", "ngram_engine"], ids=["plain", "ngram"])
def engine(request):
    return request.getfixturevalue(request.param)


def test_short_load(engine, request):
    share = 0 if request.node.callspec.id == "plain" else 1
    jobs = make_plan(REQUESTS, seed=7, max_tokens=MAX_TOKENS)[share::2]
    process = psutil.Process()
    total_blocks = engine.kv_manager.pool.num_blocks
    with LiveServer(settings(), engine) as live:
        warm = make_plan(CONCURRENCY, seed=99, max_tokens=MAX_TOKENS, bad_share=0.0)
        asyncio.run(run_load(live.url, warm, CONCURRENCY, timeout=60, deadline=30))
        wait_idle(engine)
        run = ServerRun(request.node.callspec.id, rss_before=process.memory_info().rss)
        run.results = asyncio.run(run_load(live.url, jobs, CONCURRENCY, timeout=120, deadline=120))
        idle, seen = engine_idle(live.url, timeout=20)
        assert idle, seen
        wait_idle(engine)
        assert engine.kv_manager.num_free_blocks == total_blocks
        assert not any(leftover_state(engine, live.serving).values()), leftover_state(engine, live.serving)
        run.rss_after = process.memory_info().rss
        greedy = [r.job for r in run.results if r.job.greedy and r.status == 200 and not r.error]
        alone = asyncio.run(run_alone(live.url, greedy, timeout=60))
        check_run(run, alone, engine.tokenizer)
    assert not run.problems, run.problems
    assert run.counts.get("normal", 0) >= 12 and run.counts.get("greedy", 0) >= 3, run.counts
    assert "greedy unchecked" not in run.counts and "not sent" not in run.counts
    assert {r.job.kind for r in run.results} == {"normal", "disconnect", "invalid"}
    growth = abs(run.rss_after - run.rss_before) / run.rss_before
    assert growth <= RSS_TOLERANCE, f"RSS {run.rss_before >> 20} -> {run.rss_after >> 20} MiB"
