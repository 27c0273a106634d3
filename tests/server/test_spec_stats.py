"""Per-request speculative decoding statistics through HTTP (``--per-request-spec-decode-stats``),
on a server whose engine drafts by suffix decoding: on every choice of chat and completion
responses, on the terminal chunk of a stream; summed over choices they equal the
``vllm:spec_decode_*`` counters; ``none`` leaves them out."""

import json

import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from server.spec_stats import SpecStats
from tests.server.conftest import MAX_MODEL_LEN, MODEL, LiveServer, llm_engine, settings, wait_idle  # noqa: F401
from tests.server.spec_server import COPY_PROMPT, scrape

KEYS = {"mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram", "num_spec_steps",
        "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens"}


@pytest.fixture(scope="module")
def suffix_engine(llm_engine) -> LLMEngine:
    spec = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 8, "verify_cost": 0.05})
    config = EngineConfig(ModelConfig(max_model_len=MAX_MODEL_LEN), CacheConfig(memory_bytes=64 << 20), speculative=spec)
    return LLMEngine(config, model=llm_engine.model, tokenizer=llm_engine.tokenizer)


@pytest.fixture(scope="module")
def server(suffix_engine):
    with LiveServer(settings(per_request_spec_decode_stats="detailed"), suffix_engine) as s:
        yield s


def counters(server) -> tuple[float, float, float]:
    families = scrape(server)
    return tuple(sum(s.value for s in families[f"vllm:spec_decode_{n}"] if s.name.endswith("_total"))
                 for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))


def check(stats: dict) -> None:
    assert set(stats) == KEYS | {"per_step_accepted", "per_step_drafted"}
    acc, drafted = stats["per_step_accepted"], stats["per_step_drafted"]
    assert stats["num_spec_steps"] == len(acc) == len(drafted) == sum(stats["acceptance_histogram"])
    assert stats["num_accepted_draft_tokens"] == sum(acc) and stats["num_draft_tokens"] == sum(drafted)
    assert all(0 <= a <= d for a, d in zip(acc, drafted))
    assert stats["num_spec_tokens"] == 8
    if stats["num_spec_steps"]:
        assert stats["mean_acceptance_length"] == pytest.approx(1 + sum(acc) / len(acc), abs=1e-4)
        assert stats["draft_acceptance_rate"] == pytest.approx(sum(acc) / sum(drafted), abs=1e-4)


def test_every_choice_carries_its_stats_and_they_sum_to_the_counters(server, suffix_engine):
    before = counters(server)
    http = server.http()
    body = {"model": MODEL, "max_tokens": 48, "temperature": 0}
    chat = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": COPY_PROMPT}],
                                                   "n": 2, "temperature": 0.8, "seed": 3}).json()
    comp = http.post("/v1/completions", json={**body, "prompt": COPY_PROMPT}).json()
    stream = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                          "messages": [{"role": "user", "content": COPY_PROMPT}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stream.append(json.loads(line[6:]))
    wait_idle(suffix_engine)
    choices = chat["choices"] + comp["choices"]
    stats = [c["speculative_decoding_stats"] for c in choices]
    chunks = [c for chunk in stream for c in chunk["choices"]]
    with_stats = [c for c in chunks if "speculative_decoding_stats" in c]
    assert len(with_stats) == 1 and with_stats[0]["finish_reason"] is not None  # the terminal chunk only
    stats.append(with_stats[0]["speculative_decoding_stats"])
    for s in stats:
        check(s)
    assert sum(s["num_accepted_draft_tokens"] for s in stats) > 0
    after = counters(server)
    totals = [sum(s[k] for s in stats) for k in ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")]
    assert [a - b for a, b in zip(after, before)] == totals
    usage = chat["usage"]["spec_decode"]  # the usage extension agrees
    assert usage["num_draft_tokens"] == sum(c["speculative_decoding_stats"]["num_draft_tokens"] for c in chat["choices"])


def test_summary_leaves_out_the_steps_and_none_everything():
    record = {"per_step_drafted": [3, 2, 4], "per_step_accepted": [3, 0, 1]}
    summary = SpecStats("summary", 4, True).of_choice(record)
    assert set(summary) == KEYS
    assert summary["acceptance_histogram"] == [1, 1, 0, 1, 0]
    assert summary["mean_acceptance_length"] == pytest.approx(1 + 4 / 3, abs=1e-4)
    assert summary["draft_acceptance_rate"] == pytest.approx(4 / 9, abs=1e-4)
    assert SpecStats("summary", 4, True).of_choice({})["num_spec_steps"] == 0  # speculating, never drafted
    assert SpecStats("none", 4, True).of_choice(record) is None
    assert SpecStats("summary", 4, False).of_choice({}) is None  # no speculation configured


def test_the_flag_parses_and_refuses_other_values():
    from tests.server.conftest import settings_from

    assert settings_from(["--per-request-spec-decode-stats", "summary"]).per_request_spec_decode_stats == "summary"
    assert settings_from([]).per_request_spec_decode_stats == "none"
    with pytest.raises(SystemExit):
        settings_from(["--per-request-spec-decode-stats", "all"])
