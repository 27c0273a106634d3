"""Speculative requests through HTTP: usage carries the speculation summary,
/metrics exports every name the Grafana dashboard queries, and the counters
agree with the responses."""

import json
from pathlib import Path

import pytest

from tests.deploy.conftest import TOOLS_MISSING, tool
from tests.deploy.promql import as_promql, dashboard_exprs, input_series, promtool_test, returns_data
from tests.server.conftest import MODEL, wait_idle
from tests.server.spec_server import COPY_PROMPT, K, scrape, server, spec_engine  # noqa: F401  (fixtures)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboards" / "specserve.json"
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
    gen = value(families["vllm:generation_tokens"], "vllm:generation_tokens_total")
    assert gen == sum(u.completion_tokens for u in usages)
    samples = families["vllm:spec_decode_num_draft_tokens"]
    drafted = value(samples, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL, engine="0")
    accepted = value(families["vllm:spec_decode_num_accepted_tokens"], "vllm:spec_decode_num_accepted_tokens_total")
    drafts = value(families["vllm:spec_decode_num_drafts"], "vllm:spec_decode_num_drafts_total")
    assert drafted == sum(s["num_draft_tokens"] for s in spec)
    assert accepted == sum(s["num_accepted_tokens"] for s in spec)
    assert drafts == sum(s["num_drafts"] for s in spec)
    assert 0 < accepted <= drafted
    per_pos = [
        value(families["vllm:spec_decode_num_accepted_tokens_per_pos"],
              "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
        for i in range(K)
    ]
    assert sum(per_pos) == accepted
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    rounds = value(families["specserve_spec_decode_tokens_per_round"], "specserve_spec_decode_tokens_per_round_count")
    assert rounds == drafts


def test_dashboard_queries_return_data_from_this_servers_metrics(server, tmp_path):
    """Prometheus (promtool) evaluates every dashboard query over the series of this
    live server's /metrics, with its model and method selected: none comes back empty."""
    promtool = tool("promtool")
    if promtool is None:
        pytest.skip(TOOLS_MISSING.format(name="promtool"))
    server.client().completions.create(model=MODEL, prompt=COPY_PROMPT, max_tokens=16, temperature=0)
    exprs = [as_promql(e, model_name=MODEL) for e in dashboard_exprs(json.loads(DASHBOARD.read_text()))]
    r = promtool_test(promtool, tmp_path, input_series(server.http().get("/metrics").text), returns_data(exprs))
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_request_can_opt_out_of_speculation(server, spec_engine):
    """An opted-out request drafts nothing, and its usage says so with zero counts: every reply
    of a speculating server carries ``spec_decode``."""
    r = server.client().completions.create(
        model="SmolLM2-135M-Instruct", prompt=COPY_PROMPT, max_tokens=16, temperature=0,
        extra_body={"speculative_decoding": False},
    )
    wait_idle(spec_engine)
    assert r.usage.model_extra["spec_decode"] == {
        "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "mean_acceptance_length": 1.0,
    }


def test_a_reply_without_decode_steps_carries_zero_spec_usage(server, spec_engine):
    """max_tokens 1: the token comes from the prefill, no round is drafted; chat and streamed
    completions carry the zero summary too."""
    client = server.client()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert chat.usage.model_extra["spec_decode"]["num_drafts"] == 0
    chunks = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=1, stream=True,
                                            stream_options={"include_usage": True}))
    wait_idle(spec_engine)
    assert chunks[-1].usage.model_extra["spec_decode"]["num_draft_tokens"] == 0
