"""A live server whose engine drafts by prompt lookup, shared by the speculation metric
tests and the Prometheus integration test: its fixtures (import them into the test
module), a prompt that prompt lookup drafts well, and a /metrics scrape."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from tests.server.conftest import MAX_MODEL_LEN, LiveServer, llm_engine, settings  # noqa: F401  (llm_engine: a fixture)

K = 5
COPY_PROMPT = (
    "Repeat the following list exactly, one item per line:\n"
    + "\n".join(f"item {i}: the quick brown fox jumps over the lazy dog" for i in range(8))
)


@pytest.fixture(scope="module")
def spec_engine(llm_engine) -> LLMEngine:
    config = EngineConfig(
        ModelConfig(max_model_len=MAX_MODEL_LEN),
        CacheConfig(memory_bytes=64 << 20),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=K, verify_cost=0.05),
    )
    return LLMEngine(config, model=llm_engine.model, tokenizer=llm_engine.tokenizer)


@pytest.fixture(scope="module")
def server(spec_engine):
    with LiveServer(settings(), spec_engine) as s:
        yield s


def scrape(server) -> dict[str, list]:
    text = server.http().get("/metrics").text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}
