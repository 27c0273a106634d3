"""The Grafana dashboard: a valid dashboard model, in sync with its generator, and
reading only metrics the server exports, with the labels they carry."""

import re

import pytest

from deploy import dashboard as gen
from tests.deploy.conftest import DASHBOARD, DEPLOY, load_yaml
from tests.deploy.promql import dashboard_exprs, exposition, families

# Families the server exports (tests/deploy/promql.py: its real exposition) -> (type, label names).
EXPORTED = families(exposition())
# Exported for benchmarks, not plotted: bench/spec.py reads it to split a step's time.
NOT_PLOTTED = {"specserve_decode_step_time_seconds"}


def series_names(family: str, kind: str) -> list[str]:
    """The names PromQL selects of one family (counters end in _total, histograms in _bucket/_sum/_count)."""
    return {"counter": [family + "_total"], "histogram": [family + s for s in ("_bucket", "_sum", "_count")]}.get(kind, [family])


def occurrences(expr: str, name: str) -> list[re.Match]:
    """Where ``name`` appears in ``expr`` as a whole metric name, with its matchers' text (group 1)."""
    return list(re.finditer(rf"(?<![\w:]){re.escape(name)}(?![\w:])(?:\{{([^}}]*)\}})?", expr))


def panels(dashboard: dict) -> list[dict]:
    flat = []
    for p in dashboard["panels"]:
        flat.append(p)
        flat.extend(p.get("panels", []))
    return flat


def targets(dashboard: dict) -> list[dict]:
    return [t for p in panels(dashboard) for t in p.get("targets", [])]


def test_file_is_what_the_generator_writes():
    assert DASHBOARD.read_text() == gen.render(), "stale: run .venv/bin/python -m deploy.dashboard"


def test_dashboard_model(dashboard):
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and len(dashboard["uid"]) <= 40 and dashboard["title"]
    ids = [p["id"] for p in panels(dashboard)]
    assert all(isinstance(i, int) for i in ids) and len(ids) == len(set(ids)), "panel ids must be unique integers"
    for p in panels(dashboard):
        assert p["type"] in {"row", "timeseries", "stat", "heatmap", "bargauge"}, p["type"]
        assert p["title"], p
        if p["type"] == "row":
            continue
        assert p["targets"], f"panel {p['title']!r} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"panel {p['title']!r}: duplicate refIds"
        assert all(t["expr"].strip() for t in p["targets"])
        assert p["fieldConfig"]["defaults"]["unit"]


def test_panels_tile_the_grid(dashboard):
    cells = set()
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine


def test_every_query_uses_the_provisioned_datasource(dashboard, grafana_datasource):
    uid = grafana_datasource["uid"]
    assert grafana_datasource["type"] == "prometheus"
    for p in panels(dashboard):
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": uid}, p["title"]
    for t in targets(dashboard):
        assert t["datasource"]["uid"] == uid
    for var in dashboard["templating"]["list"]:
        assert var["datasource"]["uid"] == uid


def test_template_variables(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) >= {"model_name", "method"}
    for name in ("model_name", "method"):
        v = variables[name]
        assert v["type"] == "query" and v["multi"] and v["includeAll"] and v["allValue"] == ".*"
        assert re.fullmatch(rf"label_values\(.+, {name}\)", v["query"]), v["query"]


def test_every_exported_metric_is_on_the_dashboard(dashboard):
    text = "\n".join(dashboard_exprs(dashboard))
    missing = [f for f, (kind, _) in EXPORTED.items()
               if f not in NOT_PLOTTED and not any(occurrences(text, n) for n in series_names(f, kind))]
    assert not missing, f"exported but on no panel: {missing}"


def test_selectors_filter_by_the_labels_their_metric_carries(dashboard):
    """Every selector follows $model_name; one whose metric has a method label also follows
    $method, and only those (a filter on a label the series lacks would drop them all)."""
    for expr in (t["expr"] for t in targets(dashboard)):
        for family, (kind, labels) in EXPORTED.items():
            for name in series_names(family, kind):
                for m in occurrences(expr, name):
                    matchers = m.group(1) or ""
                    assert 'model_name=~"$model_name"' in matchers, (name, expr)
                    assert ('method=~"$method"' in matchers) == ("method" in labels), (name, expr)


def test_counters_and_histograms_are_only_read_through_rate_or_increase(dashboard):
    """A raw counter plotted is a line going up forever; rates are PromQL's job."""
    cumulative = [n for f, (kind, _) in EXPORTED.items() if kind != "gauge" for n in series_names(f, kind)]
    for expr in dashboard_exprs(dashboard):
        for name in cumulative:
            for m in occurrences(expr, name):
                assert re.search(r"(rate|increase)\(\s*$", expr[: m.start()]), f"{name} outside rate()/increase(): {expr}"


@pytest.mark.parametrize(
    "title, needles",
    [
        ("Acceptance rate", ["vllm:spec_decode_num_accepted_tokens_total", "/", "vllm:spec_decode_num_draft_tokens_total"]),
        ("Mean acceptance length", ["1 + ", "vllm:spec_decode_num_drafts_total", "group_left (method)"]),
        ("Acceptance by draft position", ["by (model_name, method, position)", "group_left"]),
        ("Tokens per round over time", ["specserve_spec_decode_tokens_per_round_bucket"]),
        ("Draft tokens per second", ["vllm:spec_decode_num_draft_tokens_total", " - "]),
        ("Output tokens from drafts", ["vllm:generation_tokens_total"]),
        ("Time to first token", ["histogram_quantile(0.5,", "histogram_quantile(0.95,", "histogram_quantile(0.99,"]),
        ("Inter-token latency", ["histogram_quantile(0.5,", "histogram_quantile(0.95,", "histogram_quantile(0.99,"]),
        ("Tokens per second", ["vllm:generation_tokens_total"]),
        ("Running and waiting requests", ["vllm:num_requests_running", "vllm:num_requests_waiting"]),
        ("KV cache usage", ["vllm:kv_cache_usage_perc"]),
        ("Preemptions per second", ["vllm:num_preemptions_total"]),
        ("Prefix cache hit rate", ["vllm:prefix_cache_hits_total", " / ", "vllm:prefix_cache_queries_total"]),
        ("Paused requests and drafter fallbacks", ["specserve_spec_decode_num_paused_requests"]),
        ("Draft vs verify time per step", ["draft_time_seconds", "verify_time_seconds"]),
    ],
)
def test_required_panels(dashboard, title, needles):
    found = [p for p in panels(dashboard) if p["title"] == title and p["type"] != "stat"]
    assert found, f"no panel {title!r}"
    text = "\n".join(t["expr"] for t in found[0]["targets"])
    for needle in needles:
        assert needle in text, f"{title!r}: {needle!r} not in {text}"


def test_provisioning_points_grafana_at_the_dashboards(compose):
    (provider,) = load_yaml(DEPLOY / "grafana" / "provisioning" / "dashboards" / "specserve.yml")["providers"]
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"
