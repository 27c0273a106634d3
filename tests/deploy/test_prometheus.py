"""Prometheus: the compose stack's config, and the dashboard's PromQL run by
Prometheus' own parser and evaluator (promtool) on synthetic series."""

import json
import re
import subprocess

import pytest
import yaml

from deploy import dashboard as gen
from tests.deploy.conftest import DEPLOY
from tests.deploy.promql import (
    as_promql, dashboard_exprs, exposition, input_series, promtool_test, returns_data, run,
)


def test_config_passes_promtool(promtool):
    r = run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")])
    assert r.returncode == 0, r.stdout + r.stderr


def test_scrapes_every_replica_and_the_router(prometheus_config, compose):
    (job,) = [j for j in prometheus_config["scrape_configs"] if j["job_name"] == "specserve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    replicas = [name for name, svc in compose["services"].items() if svc.get("build", {}).get("dockerfile") == "Dockerfile"]
    assert sorted(targets) == sorted(f"{name}:8000" for name in replicas) and len(replicas) >= 2
    for target in targets:
        assert "8000" in compose["services"][target.split(":")[0]]["expose"]
    (router,) = [j for j in prometheus_config["scrape_configs"] if j["job_name"] == "router"]
    (target,) = [t for sc in router["static_configs"] for t in sc["targets"]]
    assert target == "router:" + next(a.split("=")[1] for a in compose["services"]["router"]["command"]
                                      if a.startswith("--prometheus-port="))


def test_grafana_rate_interval_matches_the_scrape_interval(prometheus_config, grafana_datasource, compose):
    assert grafana_datasource["jsonData"]["timeInterval"] == prometheus_config["global"]["scrape_interval"]
    host, port = re.fullmatch(r"http://([\w-]+):(\d+)", grafana_datasource["url"]).groups()
    assert host in compose["services"] and f"{port}:{port}" in compose["services"][host]["ports"]


def test_every_dashboard_query_parses(promtool, dashboard, tmp_path):
    """As recording rules, every expression goes through `promtool check rules`."""
    rules = [{"record": f"dashboard:query_{i}", "expr": as_promql(e)} for i, e in enumerate(dashboard_exprs(dashboard))]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    r = run([promtool, "check", "rules", str(path)])
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_dashboard_query_returns_data_from_the_servers_own_series(promtool, dashboard, tmp_path):
    """Evaluated by Prometheus over exactly the series /metrics exports (one model, one
    method selected): a name the server does not export, or a filter on a label its
    series lack, leaves an expression empty."""
    r = promtool_test(promtool, tmp_path, input_series(exposition()), returns_data(
        [as_promql(e) for e in dashboard_exprs(dashboard)]))
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("bad", [
    'sum(rate(vllm:spec_decode_num_drafts{model_name=~"m"}[5m]))',  # no _total
    'sum(rate(vllm:spec_decode_num_drafts_total{model_name=~"m", method=~"ngram"}[5m]))',  # vLLM has no method label
    'sum(rate(specserve_generation_tokens_total{model_name=~"m"}[5m]))',  # the name vLLM's replaced
])
def test_the_data_check_catches_a_wrong_name_or_label(promtool, tmp_path, bad):
    assert promtool_test(promtool, tmp_path, input_series(exposition()), returns_data([bad])).returncode != 0


def test_the_exposition_passes_promtools_lint_but_for_vllms_colons(promtool):
    """`promtool check metrics` (naming, units, types): its only complaint is the colon
    in vLLM's own names, which vLLM's servers draw as well."""
    r = subprocess.run([promtool, "check", "metrics"], input=exposition(), capture_output=True, text=True, timeout=60)
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert lines, "the lint should at least see the colons"
    assert all(line.startswith("vllm:") and line.endswith("metric names should not contain ':'") for line in lines), lines


def counter(name: str, labels: dict, per_minute: float) -> dict:
    selector = name + "{" + ", ".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    return {"series": selector, "values": f"0+{per_minute}x10"}


NGRAM = {"model_name": "m", "method": "ngram"}
DRAFT = {"model_name": "m2", "method": "draft_model"}


def vllm(labels: dict, **more) -> dict:
    """vLLM's labels of the replica that ``labels`` (model_name, method) describe."""
    return {"model_name": labels["model_name"], "engine": "0", **more}


def info(labels: dict) -> dict:
    series = ", ".join(f'{k}="{v}"' for k, v in vllm(labels, method=labels["method"]).items())
    return {"series": gen.SPEC_INFO + "{" + series + "}", "values": "1+0x10"}

# Per minute. ngram (k=3): 10 rounds, 30 drafted, 18 accepted (8, 6, 4 by position),
# so 10 * (1 + 1.8) = 28 generated tokens; draft_model: 5 rounds, 15 drafted, 5 accepted (3, 1, 1).
SERIES = [
    info(NGRAM), counter(gen.DRAFTS, vllm(NGRAM), 10), counter(gen.DRAFTED, vllm(NGRAM), 30),
    counter(gen.ACCEPTED, vllm(NGRAM), 18),
    *(counter(gen.PER_POS, vllm(NGRAM, position=str(i)), n) for i, n in enumerate((8, 6, 4))),
    counter(gen.GENERATED, vllm(NGRAM), 28),
    info(DRAFT), counter(gen.DRAFTS, vllm(DRAFT), 5), counter(gen.DRAFTED, vllm(DRAFT), 15),
    counter(gen.ACCEPTED, vllm(DRAFT), 5),
    *(counter(gen.PER_POS, vllm(DRAFT, position=str(i)), n) for i, n in enumerate((3, 1, 1))),
    counter(gen.GENERATED, vllm(DRAFT), 10),
]


def samples(values: dict[str, float], **common) -> list[dict]:
    return [{"labels": "{" + ", ".join(f'{k}="{v}"' for k, v in {**common, **lab}.items()) + "}", "value": x}
            for lab, x in ((json.loads(k), v) for k, v in values.items())]


def spec(ngram: float, draft_model: float) -> list[dict]:
    return samples({json.dumps(NGRAM): ngram, json.dumps(DRAFT): draft_model})


RANGE_STATS = {"window": gen.RANGE, "fn": "increase"}
EXPECTED = [
    (gen.acceptance_rate(), spec(0.6, 1 / 3)),
    (gen.acceptance_rate(**RANGE_STATS), spec(0.6, 1 / 3)),
    (gen.acceptance_length(), spec(2.8, 2.0)),
    (gen.acceptance_length(**RANGE_STATS), spec(2.8, 2.0)),
    (gen.draft_share(), samples({'{"model_name": "m"}': 18 / 28, '{"model_name": "m2"}': 0.5})),
    (gen.acceptance_by_position(), [
        s for i, (a, b) in enumerate(((0.8, 0.6), (0.6, 0.2), (0.4, 0.2)))
        for s in samples({json.dumps({**NGRAM, "position": str(i)}): a, json.dumps({**DRAFT, "position": str(i)}): b})
    ]),
    (f"{gen.by_method(gen.DRAFTED)} - {gen.by_method(gen.ACCEPTED)}", spec(12 / 60, 10 / 60)),
]


def test_dashboard_formulas_compute_what_they_claim(promtool, dashboard, tmp_path):
    """The dashboard's own expressions, evaluated by Prometheus on counters with known rates."""
    on_dashboard = set(dashboard_exprs(dashboard))
    for expr, _ in EXPECTED:
        assert expr in on_dashboard, f"not on the dashboard: {expr}"
    # promtool compares floats exactly: both sides are rounded to 1e-3 (as x / 1000 in both languages).
    tests = [
        {"expr": f"round({as_promql(expr, model_name='.*', method='.*')}, 0.001)", "eval_time": "10m",
         "exp_samples": [dict(s, value=round(s["value"] * 1000) / 1000) for s in exp]}
        for expr, exp in EXPECTED
    ]
    r = promtool_test(promtool, tmp_path, SERIES, tests)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("bad", ["sum(rate(x[5m])", "rate(x[5m]) by (le)"])
def test_the_parse_check_catches_errors(promtool, tmp_path, bad):
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [{"record": "r", "expr": bad}]}]}))
    assert run([promtool, "check", "rules", str(path)]).returncode != 0
