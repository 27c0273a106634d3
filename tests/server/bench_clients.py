"""What the tests of outside benchmark clients (vllm bench serve, AIPerf) share: a live
server whose engine drafts k tokens by prompt lookup every step, and its own speculative
counters, read from its registry (not through /metrics) to compare with the client's figures."""

from contextlib import contextmanager

from engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from tests.server.conftest import MAX_MODEL_LEN, MODEL, LiveServer, settings, wait_idle


@contextmanager
def ngram_server(default_engine, k: int):
    config = EngineConfig(
        ModelConfig(max_model_len=MAX_MODEL_LEN),
        CacheConfig(memory_bytes=64 << 20),
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False),
    )
    engine = LLMEngine(config, model=default_engine.model, tokenizer=default_engine.tokenizer)
    with LiveServer(settings(), engine) as s:
        yield s
    wait_idle(engine)


def spec_counters(server, k: int) -> dict:
    """drafts, draft_tokens, accepted and per_pos (k positions) under vLLM's names."""
    def get(name, **labels):
        value = server.serving.metrics.registry.get_sample_value(name, {"model_name": MODEL, "engine": "0", **labels})
        return value or 0.0

    return {
        "drafts": get("vllm:spec_decode_num_drafts_total"),
        "draft_tokens": get("vllm:spec_decode_num_draft_tokens_total"),
        "accepted": get("vllm:spec_decode_num_accepted_tokens_total"),
        "per_pos": [get("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(k)],
    }
