"""The PromQL metric-name extractor (deploy/promql_names.py)."""

import pytest

from deploy.promql_names import (
    Selector,
    dashboard_exprs,
    dashboard_metric_names,
    grafana_query_expr,
    metric_names,
    selectors,
)


@pytest.mark.parametrize(
    "expr, names",
    [
        ("up", {"up"}),
        ("job:request_rate:5m", {"job:request_rate:5m"}),  # recording-rule names have colons
        ('http_requests_total{job="api", code=~"5.."}', {"http_requests_total"}),
        ("rate(a_total[5m])", {"a_total"}),
        ("rate (a_total [ 5m ])", {"a_total"}),  # white space before "(" and "["
        ("sum(rate(a_total[1h30m:1m]))", {"a_total"}),  # subquery; "1h30m:1m" is not a name
        ("histogram_quantile(0.99, sum by (le, model_name) (rate(x_bucket[5m])))", {"x_bucket"}),
        ("sum without (instance) (a) / ignoring (code) group_left (path) b", {"a", "b"}),
        ("a / on (model_name, method) group_left sum by (model_name, method) (b)", {"a", "b"}),
        ("sum(a) BY (job) > BOOL 3", {"a"}),  # keywords in any case
        ("a and b or c unless d", {"a", "b", "c", "d"}),
        ("a atan2 b", {"a", "b"}),
        ("topk(5, a) + quantile(0.9, b) + count_values(\"value\", c)", {"a", "b", "c"}),
        ("a offset 5m + b offset -1d", {"a", "b"}),
        ("a @ 1609746000 + b @ start()", {"a", "b"}),
        ("a > Inf or b < -nan or c == 0x1F or d >= 1.5e-3", {"a", "b", "c", "d"}),
        ('label_replace(a, "dst", "$1", "src", "(.*)")', {"a"}),
        ('{__name__="a", job="x"}', {"a"}),
        ('{__name__=~"a|b"}', set()),  # a regex name is not one name
        ('{"my.metric", job="x"}', {"my.metric"}),  # Prometheus 3 quoted names
        ('a{path="}{,\\"b\\""}', {"a"}),  # braces, commas and escaped quotes inside a label value
        ("a # a comment naming b\n + c", {"a", "c"}),
        ("vector(1) + time()", set()),
        ('rate(a{model_name=~"$model_name"}[$__rate_interval]) / ${denominator}', {"a"}),
        ("increase(a[$__range]) * [[legacy_var]]", {"a"}),
    ],
)
def test_metric_names(expr, names):
    assert metric_names(expr) == names


def test_selectors_keep_their_matchers():
    got = selectors('rate(a_total{model_name=~"$model_name", method!="x"}[5m]) / b')
    assert got == [
        Selector("a_total", (("model_name", "=~", "$model_name"), ("method", "!=", "x"))),
        Selector("b"),
    ]
    assert got[0].labels == {"model_name", "method"}


def test_grouping_labels_are_not_selectors():
    """by / on / group_left lists name labels, which must not leak out as metrics."""
    assert selectors("sum by (le) (x) * on (model_name) group_right (position) y") == [Selector("x"), Selector("y")]


@pytest.mark.parametrize(
    "query, expr",
    [
        ("label_values(up, job)", "up"),
        ('label_values(a_total{model_name=~"$m, n"}, method)', 'a_total{model_name=~"$m, n"}'),
        ("label_values(job)", None),
        ("label_names()", None),
        ("metrics(specserve_.*)", None),
        ("query_result(topk(5, a))", "topk(5, a)"),
        ("sum(a)", "sum(a)"),
    ],
)
def test_grafana_variable_queries(query, expr):
    assert grafana_query_expr(query) == expr


def test_dashboard_walk_covers_rows_nested_panels_and_variables():
    dashboard = {
        "panels": [
            {"type": "timeseries", "targets": [{"expr": "rate(a_total[5m])"}, {"expr": ""}]},
            {"type": "row", "panels": [{"type": "stat", "targets": [{"expr": "b"}]}]},
            {"type": "text"},
        ],
        "templating": {
            "list": [
                {"type": "query", "query": "label_values(c, model_name)"},
                {"type": "query", "query": {"query": "label_values(d{x=\"1\"}, method)", "refId": "V"}},
                {"type": "custom", "query": "e,f"},
                {"type": "query", "query": "label_values(job)"},
            ]
        },
    }
    assert dashboard_exprs(dashboard) == ["rate(a_total[5m])", "b", "c", 'd{x="1"}']
    assert dashboard_metric_names(dashboard) == {"a_total", "b", "c", "d"}
