"""PromQL checks through Prometheus' own tools: the dashboard's expressions, the
server's real exposition turned into promtool input series, and a promtool runner.

Metric names in an expression are Prometheus' business, not a lexer of ours: an
expression is checked by evaluating it (``promtool test rules``) over the series
the server really exports; one that reads a name, or filters by a label, that the
server does not export comes back empty, which ``absent(expr)`` turns into a sample.
"""

import subprocess

import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.core.stats import EngineSnapshot, SpecStepStats, StepStats, StepTimes
from server.metrics import RequestStats, ServingMetrics

MODEL = "m"
METHOD = "ngram"
K = 3
# Grafana's variables as a user with one model and one method selected fills them in.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__range": "10m", "$model_name": MODEL, "$method": METHOD}


def as_promql(expr: str, **values: str) -> str:
    """``expr`` with Grafana's variables filled in (``values`` overrides, e.g. ``method=".*"``)."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, values.get(var.removeprefix("$"), value))
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def dashboard_exprs(dashboard: dict) -> list[str]:
    """Every PromQL expression of a Grafana dashboard: panel targets (nested panels too)
    and the series of its ``label_values(series, label)`` variables."""
    exprs = []

    def visit(panels: list) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            visit(panel.get("panels", []))

    visit(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"].strip()
            assert query.startswith("label_values(") and query.endswith(")"), query
            exprs.append(query.removeprefix("label_values(").rsplit(",", 1)[0])
    return exprs


def exposition() -> str:
    """The /metrics text of ``ServingMetrics`` with ngram speculation, after one request
    and one decode step with drafts: every family the server exports, with its labels."""
    metrics = ServingMetrics(MODEL, lambda: EngineSnapshot(2, 1, 0.25, 1))
    steps = metrics.attach_engine(METHOD, K)
    stats = RequestStats(arrival_time=0.0, num_prompt_tokens=7, finish_reason="stop")
    metrics.on_tokens(stats, 1, now=0.2)
    metrics.on_tokens(stats, 3, now=0.3)
    metrics.on_finished(stats, now=0.4)
    metrics.on_rejected("queue_full")
    spec = SpecStepStats(num_drafts=2, num_draft_tokens=6, num_accepted_tokens=3, accepted_per_pos=(2, 1, 0),
                         tokens_per_round=(3, 2), num_paused=1, num_fallbacks=1)
    steps.on_step(StepStats(StepTimes(0.01, 0.02, 0.03), 2, 2, 32, 16, ((0.01, 0.1),), spec))
    return metrics.render()[0].decode()


def families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Family name -> (type, label names) of an exposition."""
    families = text_string_to_metric_families(text)
    return {f.name: (f.type, frozenset(label for s in f.samples for label in s.labels)) for f in families}


def input_series(text: str) -> list[dict]:
    """Each sample of an exposition as a promtool input series over 10 minutes: gauges
    hold their value, counters and histograms grow by theirs (at least 1) each minute."""
    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ", ".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            values = f"{s.value}+0x10" if family.type == "gauge" else f"0+{max(s.value, 1.0)}x10"
            out.append({"series": f"{s.name}{{{labels}}}", "values": values})
    return out


def run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


def promtool_test(promtool: str, tmp_path, series: list[dict], tests: list[dict]) -> subprocess.CompletedProcess:
    """``promtool test rules`` of ``promql_expr_test`` entries over ``series`` (one a minute)."""
    path = tmp_path / "test.yml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series, "promql_expr_test": tests}
    ]}))
    return run([promtool, "test", "rules", str(path)])


def returns_data(exprs: list[str]) -> list[dict]:
    """promql_expr_tests that pass when each expression has at least one sample at 10m."""
    return [{"expr": f"absent({e})", "eval_time": "10m", "exp_samples": []} for e in exprs]
