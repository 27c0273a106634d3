"""Preemption under KV pressure with speculation on: sixteen concurrent streamed
greedy requests on a server whose KV pool holds a fraction of what they need
(and whose draft slots take room too) all finish, each stream well formed, with
the same text as the unpressured run; every block comes back."""

import pytest

from engine.config import SpeculativeConfig
from tests.reliability.conftest import finish_reason, in_threads, make_engine, ngram_config, stream, stream_text
from tests.server.conftest import LiveServer, settings, wait_idle

MAX_TOKENS = 16
TOPICS = ["the sea", "a fox", "Paris", "rain", "a robot", "tea", "the moon", "bread"]
# Mixed lengths; half of them repetitive, so that n-gram drafts are proposed and accepted.
PROMPTS = [f"Write one sentence about {t}." for t in TOPICS] + [
    f"Repeat after me: {t}, {t}, {t}, {t}, {t}, {t}," for t in TOPICS
]
NUM_BLOCKS = 12  # 192 tokens of 16 for 16 requests of about 30-45 tokens each


def run_all(url: str) -> list:
    bodies = [{"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True} for p in PROMPTS]
    return in_threads(stream, [(url, b) for b in bodies])


@pytest.fixture(scope="module")
def unpressured(rel_engine) -> list[str]:
    """The plain engine's greedy texts (what speculation must reproduce)."""
    with LiveServer(settings(), rel_engine) as live:
        return [stream_text(events) for _, events in run_all(live.url)]


@pytest.mark.parametrize(
    "spec",
    [
        ngram_config(k=4),
        pytest.param(
            SpeculativeConfig(
                method="early_exit", num_speculative_tokens=3, num_layers=8, verify_cost=0.05, adaptive=False
            ),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["ngram", "early_exit"],
)
def test_sixteen_requests_on_a_tiny_pool_with_speculation(default_engine, unpressured, spec):
    engine = make_engine(default_engine, num_blocks=NUM_BLOCKS, max_model_len=128, spec=spec)
    stats = []
    engine.stat_loggers.append(stats.append)
    with LiveServer(settings(), engine) as live:
        results = run_all(live.url)
        wait_idle(engine)
    assert engine.scheduler.num_preemptions > 0  # the pressure was real
    assert sum(s.spec.num_drafts for s in stats if s.spec) > 0  # and so was the speculation
    for (status, events), want in zip(results, unpressured, strict=True):
        assert status == 200 and events[-1] == "[DONE]" and finish_reason(events) == "length"
        assert stream_text(events) == want
    assert engine.kv_manager.num_free_blocks == NUM_BLOCKS
    if hasattr(engine.speculator.drafter, "kv"):
        assert engine.speculator.drafter.kv.num_free_blocks == engine.speculator.drafter.kv.pool.num_blocks
