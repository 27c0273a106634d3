"""The Grafana dashboard of specserve, as code.

    .venv/bin/python -m deploy.dashboard            # rewrites DASHBOARD_PATH
    .venv/bin/python -m deploy.dashboard --check    # exit 1 when the file is stale

The JSON file is what Grafana provisions; it is generated from this module, and
tests/deploy checks that the two agree, so edit here, never in Grafana's UI.

The server exports counters, histograms and instantaneous gauges only; every
rate and ratio is derived here in PromQL, summed before dividing, so that it
aggregates across replicas::

    acceptance rate          accepted draft tokens / drafted tokens
    mean acceptance length   1 + accepted draft tokens / drafting rounds  (tokens per round)
    acceptance at position i accepted at i / drafting rounds
    rejected tokens          drafted - accepted
    draft share of output    accepted draft tokens / generation tokens
    prefix cache hit rate    prefix-cache hit tokens / queried tokens

Most series carry vLLM's names (``vllm:*``, labels ``model_name`` and ``engine``:
server/metrics.py says why); vLLM's speculative counters have no ``method``
label, so the speculation panels join it from ``specserve_speculative_config_info``
(``by_method``) to follow the ``$method`` variable.

Time-series panels use ``rate(...[$__rate_interval])``; the summary stats at the
top use ``increase(...[$__range])`` over the whole time range shown.
"""

import json
import sys
from pathlib import Path

DATASOURCE_UID = "specserve-prometheus"  # = grafana/provisioning/datasources/prometheus.yml
DASHBOARD_UID = "specserve-speculation"
DASHBOARD_PATH = Path(__file__).parent / "grafana" / "dashboards" / "specserve.json"
SCHEMA_VERSION = 39  # Grafana 11

DS = {"type": "prometheus", "uid": DATASOURCE_UID}
SERVING = 'model_name=~"$model_name"'
SPEC = 'model_name=~"$model_name", method=~"$method"'
BY_SPEC = "model_name, method"
RATE = "$__rate_interval"
RANGE = "$__range"

ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
DRAFTS = "vllm:spec_decode_num_drafts_total"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SPEC_INFO = "specserve_speculative_config_info"
GENERATED = "vllm:generation_tokens_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
# One replica's series: the scrape's target labels plus vLLM's own.
SAME_ENGINE = "job, instance, model_name, engine"


# -- PromQL --------------------------------------------------------------------


def agg(metric: str, sel: str, by: str, window: str = RATE, fn: str = "rate") -> str:
    """``sum by (by) (fn(metric{sel}[window]))``."""
    return f"sum by ({by}) ({fn}({metric}{{{sel}}}[{window}]))"


def ratio(num: str, den: str, sel: str = SERVING, by: str = "model_name", window: str = RATE, fn: str = "rate") -> str:
    return f"{agg(num, sel, by, window, fn)} / {agg(den, sel, by, window, fn)}"


def by_method(metric: str, by: str = BY_SPEC, window: str = RATE, fn: str = "rate") -> str:
    """``sum by (by) (fn(metric[window]))`` of a vLLM speculative counter, each replica's
    series given its ``method`` (and filtered by ``$method``) from the info metric."""
    joined = f"{fn}({metric}{{{SERVING}}}[{window}]) * on ({SAME_ENGINE}) group_left (method) {SPEC_INFO}{{{SPEC}}}"
    return f"sum by ({by}) ({joined})"


def spec_ratio(num: str, den: str, window: str = RATE, fn: str = "rate") -> str:
    return f"{by_method(num, window=window, fn=fn)} / {by_method(den, window=window, fn=fn)}"


def quantile(q: float, histogram: str, sel: str = SERVING, by: str = "model_name") -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({histogram}_bucket{{{sel}}}[{RATE}])))"


def mean(histogram: str, sel: str = SERVING, by: str = "model_name") -> str:
    return ratio(histogram + "_sum", histogram + "_count", sel, by)


def acceptance_rate(window: str = RATE, fn: str = "rate") -> str:
    return spec_ratio(ACCEPTED, DRAFTED, window, fn)


def acceptance_length(window: str = RATE, fn: str = "rate") -> str:
    return "1 + " + spec_ratio(ACCEPTED, DRAFTS, window, fn)


def draft_share(window: str = RATE, fn: str = "rate") -> str:
    return f"{by_method(ACCEPTED, 'model_name', window, fn)} / {agg(GENERATED, SERVING, 'model_name', window, fn)}"


def acceptance_by_position(window: str = RATE, fn: str = "rate") -> str:
    return (
        f"{by_method(PER_POS, BY_SPEC + ', position', window, fn)}"
        f" / on ({BY_SPEC}) group_left {by_method(DRAFTS, BY_SPEC, window, fn)}"
    )


# -- panels --------------------------------------------------------------------


def target(expr: str, legend: str = "", instant: bool = False, fmt: str = "time_series") -> dict:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend or "__auto", "format": fmt, "range": not instant}
    if instant:
        t["instant"] = True
    return t


def panel(kind: str, title: str, description: str, targets: list[dict], w: int, h: int, unit: str = "short", **defaults) -> dict:
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"w": w, "h": h},
        "targets": [dict(t, refId=chr(ord("A") + i)) for i, t in enumerate(targets)],
        "fieldConfig": {"defaults": {"unit": unit, **defaults}, "overrides": []},
        "options": {},
    }


def timeseries(title: str, description: str, targets: list[dict], unit: str = "short", w: int = 12, h: int = 8, **defaults) -> dict:
    p = panel("timeseries", title, description, targets, w, h, unit, **defaults)
    p["fieldConfig"]["defaults"]["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    p["options"] = {
        "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True, "calcs": ["mean", "lastNotNull", "max"]},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return p


def stat(title: str, description: str, expr: str, legend: str, unit: str = "short", decimals: int = 2) -> dict:
    p = panel("stat", title, description, [target(expr, legend, instant=True)], 4, 4, unit, decimals=decimals)
    p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "value", "graphMode": "none", "textMode": "auto"}
    return p


def histogram_heatmap(title: str, description: str, histogram: str, sel: str, w: int = 12, h: int = 8) -> dict:
    """Buckets over time: Grafana turns the cumulative ``le`` buckets into per-bucket counts."""
    expr = f"sum by (le) (increase({histogram}_bucket{{{sel}}}[{RATE}]))"
    p = panel("heatmap", title, description, [target(expr, "{{le}}", fmt="heatmap")], w, h)
    p["options"] = {
        "calculate": False,
        "cellGap": 1,
        "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
        "yAxis": {"axisPlacement": "left", "unit": "short"},
        "rowsFrame": {"layout": "le"},
        "tooltip": {"mode": "single", "yHistogram": True},
        "legend": {"show": True},
    }
    return p


def histogram_bars(title: str, description: str, histogram: str, sel: str, w: int = 12, h: int = 8) -> dict:
    """The distribution over the whole time range, one bar per bucket."""
    expr = f"sum by (le) (increase({histogram}_bucket{{{sel}}}[{RANGE}]))"
    p = panel("bargauge", title, description, [target(expr, "{{le}}", instant=True, fmt="heatmap")], w, h)
    p["options"] = {
        "displayMode": "gradient",
        "orientation": "vertical",
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "showUnfilled": True,
    }
    return p


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": [], "gridPos": {"w": 24, "h": 1}}


def percentiles(histogram: str, sel: str = SERVING, by: str = "model_name", what: str = "") -> list[dict]:
    legend = "{{" + "}} {{".join(b.strip() for b in by.split(",")) + "}}"
    return [target(quantile(q, histogram, sel, by), f"p{round(q * 100)} {what}{legend}") for q in (0.5, 0.95, 0.99)]


# -- the dashboard -------------------------------------------------------------

SPEC_LEGEND = "{{model_name}} {{method}}"


def speculation_panels() -> list[dict]:
    rng = {"window": RANGE, "fn": "increase"}
    return [
        row("Speculative decoding"),
        stat("Acceptance rate", "Accepted draft tokens / drafted tokens over the time range.", acceptance_rate(**rng), SPEC_LEGEND, "percentunit"),
        stat("Mean acceptance length", "Tokens emitted per drafting round (1 + accepted / rounds) over the time range.", acceptance_length(**rng), SPEC_LEGEND),
        stat("Output from drafts", "Accepted draft tokens / all generated tokens over the time range.", draft_share(**rng), "{{model_name}}", "percentunit"),
        stat("Drafting rounds", "Drafting rounds (one per request per step) over the time range.", by_method(DRAFTS, window=RANGE, fn="increase"), SPEC_LEGEND, decimals=0),
        stat("Drafter fallbacks", "Drafter failures (the step went on without drafts) over the time range.",
             agg("specserve_spec_decode_fallbacks_total", SPEC, BY_SPEC, RANGE, "increase"), SPEC_LEGEND, decimals=0),
        stat("Paused requests", "Requests whose speculation is paused now.",
             f"sum by ({BY_SPEC}) (specserve_spec_decode_num_paused_requests{{{SPEC}}})", SPEC_LEGEND, decimals=0),
        timeseries("Acceptance rate", "Accepted draft tokens / drafted tokens.", [target(acceptance_rate(), SPEC_LEGEND)],
                   "percentunit", min=0, max=1),
        timeseries("Mean acceptance length", "Tokens emitted per drafting round: 1 + accepted / rounds (1 .. k+1).",
                   [target(acceptance_length(), SPEC_LEGEND)], min=1),
        timeseries("Acceptance by draft position", "Share of drafting rounds whose draft token at this position was accepted "
                   "(accepted at position i / rounds); falls with the position.",
                   [target(acceptance_by_position(), "pos {{position}} " + SPEC_LEGEND)], "percentunit", min=0, max=1),
        histogram_bars("Tokens per round (time range)", "How many tokens each drafting round emitted, over the time range "
                       "(bucket le=n: rounds that emitted n tokens).", "specserve_spec_decode_tokens_per_round", SPEC),
        histogram_heatmap("Tokens per round over time", "Drafting rounds per bucket of emitted tokens, over time.",
                          "specserve_spec_decode_tokens_per_round", SPEC),
        timeseries("Draft tokens per second", "Drafted, accepted and rejected (drafted - accepted) draft tokens per second.", [
            target(by_method(DRAFTED), "drafted " + SPEC_LEGEND),
            target(by_method(ACCEPTED), "accepted " + SPEC_LEGEND),
            target(f"{by_method(DRAFTED)} - {by_method(ACCEPTED)}", "rejected " + SPEC_LEGEND),
        ], "suffix: tok/s", min=0),
        timeseries("Output tokens from drafts", "Accepted draft tokens / all generated tokens: the share of the output "
                   "that speculation produced beyond one token per step.", [target(draft_share(), "{{model_name}}")],
                   "percentunit", min=0, max=1),
        timeseries("Draft vs verify time per step", "Mean and p95 time per engine step spent drafting, and in the target "
                   "pass plus verification.", [
            target(mean("specserve_spec_decode_draft_time_seconds", SPEC, BY_SPEC), "draft mean " + SPEC_LEGEND),
            target(mean("specserve_spec_decode_verify_time_seconds", SPEC, BY_SPEC), "verify mean " + SPEC_LEGEND),
            target(quantile(0.95, "specserve_spec_decode_draft_time_seconds", SPEC, BY_SPEC), "draft p95 " + SPEC_LEGEND),
            target(quantile(0.95, "specserve_spec_decode_verify_time_seconds", SPEC, BY_SPEC), "verify p95 " + SPEC_LEGEND),
        ], "s", min=0),
        timeseries("Paused requests and drafter fallbacks", "Requests with speculation paused (now), drafter failures per second.", [
            target(f"sum by ({BY_SPEC}) (specserve_spec_decode_num_paused_requests{{{SPEC}}})", "paused " + SPEC_LEGEND),
            target(agg("specserve_spec_decode_fallbacks_total", SPEC, BY_SPEC), "fallbacks/s " + SPEC_LEGEND),
        ], min=0),
    ]


def serving_panels() -> list[dict]:
    return [
        row("Latency"),
        timeseries("Time to first token", "Arrival to first output token.",
                   percentiles("vllm:time_to_first_token_seconds"), "s", min=0),
        timeseries("Inter-token latency", "Gap between output tokens (a step emitting k tokens counts k gaps of t/k).",
                   percentiles("vllm:inter_token_latency_seconds"), "s", min=0),
        timeseries("End-to-end request latency", "Arrival to the end of the request.",
                   percentiles("vllm:e2e_request_latency_seconds"), "s", min=0),
        timeseries("Queue and prefill time", "Time waiting to be scheduled, and time computing the prompt.",
                   percentiles("vllm:request_queue_time_seconds", what="queue ")
                   + percentiles("vllm:request_prefill_time_seconds", what="prefill "), "s", min=0),
        row("Throughput and load"),
        timeseries("Tokens per second", "Generated and prompt tokens per second.", [
            target(agg(GENERATED, SERVING, "model_name"), "generated {{model_name}}"),
            target(agg("vllm:prompt_tokens_total", SERVING, "model_name"), "prompt {{model_name}}"),
        ], "suffix: tok/s", min=0),
        timeseries("Requests per second", "Ended requests by finish reason, refused requests by reason.", [
            target(agg("vllm:request_success_total", SERVING, "model_name, finished_reason"), "{{finished_reason}} {{model_name}}"),
            target(agg("specserve_request_rejected_total", SERVING, "model_name, reason"), "rejected: {{reason}} {{model_name}}"),
        ], "reqps", min=0),
        timeseries("Tokens per engine step", "Tokens computed per engine step (prefill chunks, decodes and verified drafts).",
                   [target(mean("specserve_step_tokens"), "mean {{model_name}}")] + percentiles("specserve_step_tokens")[1:], min=0),
        timeseries("Running and waiting requests", "Requests in the running batch and in the queue.", [
            target(f"sum by (model_name) (vllm:num_requests_running{{{SERVING}}})", "running {{model_name}}"),
            target(f"sum by (model_name) (vllm:num_requests_waiting{{{SERVING}}})", "waiting {{model_name}}"),
        ], min=0),
        timeseries("KV cache usage", "Share of KV-cache blocks in use, per replica.",
                   [target(f"vllm:kv_cache_usage_perc{{{SERVING}}}", "{{model_name}} {{instance}}")], "percentunit", min=0, max=1),
        timeseries("Prefix cache hit rate", "Tokens of admitted requests found in the prefix cache / tokens looked up "
                   "(no data with prefix caching off).",
                   [target(ratio(PREFIX_HITS, PREFIX_QUERIES, SERVING, "model_name"), "{{model_name}}")],
                   "percentunit", min=0, max=1),
        timeseries("Preemptions per second", "Requests preempted because the KV cache was full.",
                   [target(agg("vllm:num_preemptions_total", SERVING, "model_name"), "{{model_name}}")], min=0),
    ]


def variable(name: str, label: str, query: str) -> dict:
    return {
        "type": "query", "name": name, "label": label, "datasource": DS,
        "query": query, "definition": query, "refresh": 2, "sort": 1, "regex": "",
        "multi": True, "includeAll": True, "allValue": ".*", "current": {}, "options": [], "hide": 0,
    }


def layout(panels: list[dict]) -> list[dict]:
    """Numbers the panels and places them left to right, wrapping at Grafana's 24 columns."""
    x = y = line_h = 0
    for i, p in enumerate(panels, start=1):
        pos = p["gridPos"]
        if x + pos["w"] > 24 or p["type"] == "row":
            x, y, line_h = 0, y + line_h, 0
        p["id"] = i
        pos.update(x=x, y=y)
        x, line_h = x + pos["w"], max(line_h, pos["h"])
    return panels


def build_dashboard() -> dict:
    return {
        "uid": DASHBOARD_UID,
        "title": "specserve: speculative decoding",
        "description": "Speculation quality and cost, latency, throughput and load of specserve replicas.",
        "tags": ["specserve", "llm", "speculative-decoding"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [
            variable("model_name", "model", "label_values(vllm:num_requests_running, model_name)"),
            variable("method", "method", f'label_values({SPEC_INFO}{{model_name=~"$model_name"}}, method)'),
        ]},
        "panels": layout(speculation_panels() + serving_panels()),
    }


def render() -> str:
    return json.dumps(build_dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if DASHBOARD_PATH.read_text() != text:
            print(f"{DASHBOARD_PATH} is stale: run python -m deploy.dashboard", file=sys.stderr)
            return 1
        return 0
    DASHBOARD_PATH.parent.mkdir(parents=True, exist_ok=True)
    DASHBOARD_PATH.write_text(text)
    print(DASHBOARD_PATH)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
