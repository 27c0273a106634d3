"""The metric names a PromQL expression (or a Grafana dashboard) reads.

Not a PromQL parser: a small lexer that is exact about the parts that can look
like a metric name but are not one. Worked example::

    histogram_quantile(0.99, sum by (le, model_name) (
        rate(specserve_time_to_first_token_seconds_bucket{model_name=~"$model_name"}[$__rate_interval])))

    histogram_quantile( rate(   function calls: an identifier followed by "("
    0.99                        number
    sum by (le, model_name)     aggregation keyword + grouping label list
    {model_name=~"..."}         label matchers (kept as the selector's matchers)
    [$__rate_interval]          range, durations, Grafana variables
    -> {"specserve_time_to_first_token_seconds_bucket"}

Also skipped: strings, comments, ``offset 5m``, ``@ 1700000000``, binary operators
and their modifiers (``on (...) group_left (...)``, ``bool``), ``inf``/``nan``,
Grafana variables (``$var``, ``${var}``, ``[[var]]``). A selector without a name
before its braces takes it from ``__name__="..."`` or from a quoted name
(``{"my.metric"}``, Prometheus 3).

    python -m deploy.promql_names deploy/grafana/dashboards/*.json
"""

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass

AGGREGATIONS = frozenset(
    "sum avg count min max group stddev stdvar topk bottomk count_values quantile limitk limit_ratio".split()
)
# Keywords whose "(" opens a list of label names, not an expression.
GROUPING = frozenset("by without on ignoring group_left group_right".split())
KEYWORDS = AGGREGATIONS | GROUPING | frozenset("and or unless bool offset atan2 inf nan".split())

_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|(?:(?:\d+(?:ms|[smhdwy]))+)|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_GRAFANA_VAR = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[[^\]]*\]\]")
_MATCH_OP = re.compile(r"\s*(=~|!~|!=|=)\s*")


@dataclass(frozen=True)
class Selector:
    """One vector selector: its metric name ("" when none can be known) and label matchers."""

    name: str
    matchers: tuple[tuple[str, str, str], ...] = ()  # (label, op, value)

    @property
    def labels(self) -> frozenset[str]:
        return frozenset(label for label, _, _ in self.matchers)


def selectors(expr: str) -> list[Selector]:
    """The vector selectors of ``expr``, in order of appearance."""
    return list(_Lexer(expr).selectors())


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` reads."""
    return {s.name for s in selectors(expr) if s.name}


def grafana_query_expr(query: str) -> str | None:
    """The PromQL inside a Grafana Prometheus variable query, or None when it has none.

    ``label_values(metric{...}, label)`` -> ``metric{...}``; ``label_values(label)``,
    ``label_names()``, ``metrics(regex)`` -> None; ``query_result(expr)`` -> ``expr``;
    anything else is taken as PromQL.
    """
    q = query.strip()
    m = re.fullmatch(r"label_values\((.*),\s*[A-Za-z_][A-Za-z0-9_]*\s*\)", q, re.S)
    if m:
        return m.group(1)
    if re.fullmatch(r"(label_values|label_names|metrics)\(.*\)", q, re.S):
        return None
    m = re.fullmatch(r"query_result\((.*)\)", q, re.S)
    return m.group(1) if m else q


def dashboard_exprs(dashboard: dict) -> list[str]:
    """Every PromQL expression of a Grafana dashboard model: panel targets (rows and
    library-less nested panels included) and template variable queries."""
    exprs = []

    def visit(panels: list) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            visit(panel.get("panels", []))

    visit(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        expr = grafana_query_expr(query)
        if expr:
            exprs.append(expr)
    return exprs


def dashboard_metric_names(dashboard: dict) -> set[str]:
    return set().union(*(metric_names(e) for e in dashboard_exprs(dashboard)))


class _Lexer:
    def __init__(self, expr: str):
        self.s = expr
        self.i = 0

    def selectors(self) -> Iterator[Selector]:
        s = self.s
        while self.i < len(s):
            c = s[self.i]
            if c.isspace():
                self.i += 1
            elif c == "#":
                end = s.find("\n", self.i)
                self.i = len(s) if end < 0 else end
            elif c in "\"'`":
                self._string()
            elif c == "$" or s.startswith("[[", self.i):
                m = _GRAFANA_VAR.match(s, self.i)
                self.i = m.end() if m else self.i + 1
            elif c == "[":
                self._skip_to("]")
            elif c == "{":
                name, matchers = self._matchers()
                yield Selector(name, matchers)
            elif c.isdigit() or (c == "." and s[self.i + 1 : self.i + 2].isdigit()):
                self.i = _NUMBER.match(s, self.i).end()
            elif _IDENT.match(s, self.i):
                yield from self._identifier()
            else:
                self.i += 1

    def _identifier(self) -> Iterator[Selector]:
        m = _IDENT.match(self.s, self.i)
        word, self.i = m.group(), m.end()
        nxt = self._peek()
        if word.lower() in KEYWORDS:
            if word.lower() in GROUPING and nxt == "(":
                self._skip_to(")")
        elif nxt == "(":
            pass  # a function call: its arguments are lexed as they come
        elif nxt == "{":
            _, matchers = self._matchers()
            yield Selector(word, matchers)
        else:
            yield Selector(word)

    def _peek(self) -> str:
        """Skips white space; returns the next character ("" at the end)."""
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1
        return self.s[self.i] if self.i < len(self.s) else ""

    def _string(self) -> str:
        """Consumes the string literal at ``self.i`` and returns its (unescaped) value."""
        s, quote = self.s, self.s[self.i]
        j, out = self.i + 1, []
        while j < len(s) and s[j] != quote:
            if s[j] == "\\" and quote != "`" and j + 1 < len(s):
                j += 1
            out.append(s[j])
            j += 1
        self.i = j + 1
        return "".join(out)

    def _skip_to(self, close: str) -> None:
        """Skips a bracketed part (``[5m:1m]``, ``(le, model_name)``), strings inside included."""
        while self.i < len(self.s) and self.s[self.i] != close:
            if self.s[self.i] in "\"'`":
                self._string()
            else:
                self.i += 1
        self.i += 1

    def _matchers(self) -> tuple[str, tuple[tuple[str, str, str], ...]]:
        """Parses ``{label op "value", ...}`` at ``self.i``; returns the name it gives (if any)."""
        self.i += 1
        name, matchers = "", []
        while self.i < len(self.s):
            nxt = self._peek()
            if nxt in ("}", ""):
                self.i += 1
                break
            if nxt == ",":
                self.i += 1
                continue
            if nxt in "\"'`":
                label = self._string()
            else:
                m = _IDENT.match(self.s, self.i)
                if not m:  # not PromQL; stop rather than loop
                    self._skip_to("}")
                    break
                label, self.i = m.group(), m.end()
            op = _MATCH_OP.match(self.s, self.i)
            if op is None:  # a quoted metric name: {"my.metric", job="x"}
                name = label
                continue
            self.i = op.end()
            value = self._string() if self._peek() in "\"'`" else ""
            matchers.append((label, op.group(1), value))
            if label == "__name__" and op.group(1) == "=":
                name = value
        return name, tuple(m for m in matchers if m[0] != "__name__")


def main(argv: list[str]) -> int:
    for path in argv:
        with open(path) as f:
            for name in sorted(dashboard_metric_names(json.load(f))):
                print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
