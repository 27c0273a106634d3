"""The Grafana dashboard: a valid dashboard model, in sync with its generator, and
reading only metrics the server exports, with the labels they carry."""

import re

import pytest

from deploy import dashboard as gen
from deploy.promql_names import dashboard_metric_names, selectors
from tests.deploy.conftest import DASHBOARD, DEPLOY, load_yaml

# What the server exports (server/metrics.py and the spec-decode metrics), by the
# family name of the exposition format. All carry model_name; specserve_spec_decode_*
# also carry method.
EXPORTED_METRICS: dict[str, str] = {
    "specserve_request_finished_total": "counter",  # finish_reason
    "specserve_request_rejected_total": "counter",  # reason
    "specserve_prompt_tokens_total": "counter",
    "specserve_generation_tokens_total": "counter",
    "specserve_time_to_first_token_seconds": "histogram",
    "specserve_inter_token_latency_seconds": "histogram",
    "specserve_e2e_request_latency_seconds": "histogram",
    "specserve_request_queue_time_seconds": "histogram",
    "specserve_request_prefill_time_seconds": "histogram",
    "specserve_step_tokens": "histogram",
    "specserve_num_requests_running": "gauge",
    "specserve_num_requests_waiting": "gauge",
    "specserve_kv_cache_usage_perc": "gauge",
    "specserve_num_preemptions_total": "counter",
    "specserve_prefix_cache_queries_total": "counter",
    "specserve_prefix_cache_hits_total": "counter",
    "specserve_spec_decode_num_drafts_total": "counter",
    "specserve_spec_decode_num_draft_tokens_total": "counter",
    "specserve_spec_decode_num_accepted_tokens_total": "counter",
    "specserve_spec_decode_num_accepted_tokens_per_pos_total": "counter",  # position
    "specserve_spec_decode_tokens_per_round": "histogram",
    "specserve_spec_decode_draft_time_seconds": "histogram",
    "specserve_spec_decode_verify_time_seconds": "histogram",
    "specserve_spec_decode_num_paused_requests": "gauge",
    "specserve_spec_decode_fallbacks_total": "counter",
}


def exported_series() -> dict[str, str]:
    """Series names PromQL can select -> their family's type (histograms as _bucket/_sum/_count)."""
    out = {}
    for name, kind in EXPORTED_METRICS.items():
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        out.update({name + s: kind for s in suffixes})
    return out


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


def test_every_referenced_metric_is_exported(dashboard):
    unknown = dashboard_metric_names(dashboard) - set(exported_series())
    assert not unknown, f"the dashboard reads metrics the server does not export: {sorted(unknown)}"


def test_every_exported_metric_is_on_the_dashboard(dashboard):
    families = {re.sub(r"_(bucket|sum|count)$", "", n) for n in dashboard_metric_names(dashboard)}
    assert set(EXPORTED_METRICS) - families == set()


def test_selectors_filter_by_the_labels_their_metric_carries(dashboard):
    """Every panel query follows $model_name; spec-decode metrics also follow $method,
    and only they (other metrics have no method label: the filter would drop them)."""
    for t in targets(dashboard):
        for sel in selectors(t["expr"]):
            matchers = {(label, op, value) for label, op, value in sel.matchers}
            assert ("model_name", "=~", "$model_name") in matchers, (sel, t["expr"])
            spec = sel.name.startswith("specserve_spec_decode_")
            assert (("method", "=~", "$method") in matchers) == spec, (sel, t["expr"])


def test_counters_and_histograms_are_only_read_through_rate_or_increase(dashboard):
    """A raw counter plotted is a line going up forever; rates are PromQL's job."""
    cumulative = [n for n, kind in exported_series().items() if kind != "gauge"]
    for expr in (t["expr"] for t in targets(dashboard)):
        for name in cumulative:
            for m in re.finditer(rf"(?<![\w:]){re.escape(name)}(?![\w:])", expr):
                assert re.search(r"(rate|increase)\(\s*$", expr[: m.start()]), f"{name} outside rate()/increase(): {expr}"


@pytest.mark.parametrize(
    "title, needles",
    [
        ("Acceptance rate", ["specserve_spec_decode_num_accepted_tokens_total", "/", "specserve_spec_decode_num_draft_tokens_total"]),
        ("Mean acceptance length", ["1 + ", "specserve_spec_decode_num_drafts_total"]),
        ("Acceptance by draft position", ["by (model_name, method, position)", "group_left"]),
        ("Tokens per round over time", ["specserve_spec_decode_tokens_per_round_bucket"]),
        ("Draft tokens per second", ["specserve_spec_decode_num_draft_tokens_total", " - "]),
        ("Output tokens from drafts", ["specserve_generation_tokens_total"]),
        ("Time to first token", ["histogram_quantile(0.5,", "histogram_quantile(0.95,", "histogram_quantile(0.99,"]),
        ("Inter-token latency", ["histogram_quantile(0.5,", "histogram_quantile(0.95,", "histogram_quantile(0.99,"]),
        ("Tokens per second", ["specserve_generation_tokens_total"]),
        ("Running and waiting requests", ["specserve_num_requests_running", "specserve_num_requests_waiting"]),
        ("KV cache usage", ["specserve_kv_cache_usage_perc"]),
        ("Preemptions per second", ["specserve_num_preemptions_total"]),
        ("Prefix cache hit rate", ["specserve_prefix_cache_hits_total", " / ", "specserve_prefix_cache_queries_total"]),
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
