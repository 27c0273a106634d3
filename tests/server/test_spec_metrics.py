"""Speculative requests through HTTP: usage carries the speculation summary,
/metrics exports every name the Grafana dashboard queries, and the counters
agree with the responses."""

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.promql_names import dashboard_metric_names
from engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from tests.server.conftest import MAX_MODEL_LEN, LiveServer, settings, wait_idle

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "specserve.json"
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


def value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_spec_requests_report_usage_and_consistent_counters(server, spec_engine):
    client = server.client()
    usages = []
    for i in range(3):
        r = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": COPY_PROMPT}],
            max_tokens=48,
            temperature=0 if i < 2 else 0.7,
            seed=i,
        )
        usages.append(r.usage)
    wait_idle(spec_engine)
    spec = [u.model_extra["spec_decode"] for u in usages]
    assert all(s["num_draft_tokens"] > 0 for s in spec)
    assert all(s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"]) for s in spec)

    families = scrape(server)
    gen = value(families["specserve_generation_tokens"], "specserve_generation_tokens_total")
    assert gen == sum(u.completion_tokens for u in usages)
    samples = families["specserve_spec_decode_num_draft_tokens"]
    drafted = value(samples, "specserve_spec_decode_num_draft_tokens_total", method="ngram")
    accepted = value(families["specserve_spec_decode_num_accepted_tokens"], "specserve_spec_decode_num_accepted_tokens_total")
    drafts = value(families["specserve_spec_decode_num_drafts"], "specserve_spec_decode_num_drafts_total")
    assert drafted == sum(s["num_draft_tokens"] for s in spec)
    assert accepted == sum(s["num_accepted_tokens"] for s in spec)
    assert drafts == sum(s["num_drafts"] for s in spec)
    assert 0 < accepted <= drafted
    per_pos = [
        value(families["specserve_spec_decode_num_accepted_tokens_per_pos"],
              "specserve_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(K)
    ]
    assert sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    rounds = value(families["specserve_spec_decode_tokens_per_round"], "specserve_spec_decode_tokens_per_round_count")
    assert rounds == drafts


def test_dashboard_queries_only_exported_metrics(server):
    families = scrape(server)
    exported = set()
    for name, samples in families.items():
        exported.add(name)
        exported.update(s.name for s in samples)
    wanted = dashboard_metric_names(json.loads(DASHBOARD.read_text()))
    assert wanted, "the dashboard has no queries"
    assert wanted <= exported, f"dashboard queries metrics the server does not export: {sorted(wanted - exported)}"


def test_a_request_can_opt_out_of_speculation(server, spec_engine):
    r = server.client().completions.create(
        model="SmolLM2-135M-Instruct", prompt=COPY_PROMPT, max_tokens=16, temperature=0,
        extra_body={"speculative_decoding": False},
    )
    wait_idle(spec_engine)
    assert "spec_decode" not in (r.usage.model_extra or {})
