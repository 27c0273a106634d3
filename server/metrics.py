"""The one Prometheus adapter: every prometheus_client object of the server lives here.

Two kinds of input:

* ``RequestStats``, one per engine request (one choice of one HTTP request),
  updated by the serving layer as deltas arrive and reported when it ends;
* ``EngineSnapshot`` (``engine.core.stats``), pushed by the engine thread after each
  step and read when Prometheus scrapes: running and waiting requests, KV-cache
  usage, preemptions so far.

Names. A quantity vLLM exports is exported under vLLM's name, type, labels
(``model_name``, ``engine``) and buckets, always and only there, so that tools
built around vLLM (``vllm bench serve``, routers, llm-d's endpoint picker, KEDA)
read specserve unchanged, and each quantity has one name. What vLLM has no name
for is ``specserve_*``; the speculative method, a label vLLM does not have, is on
``specserve_speculative_config_info`` for PromQL to join. Metrics live in a
per-app ``CollectorRegistry`` (tests build several apps). Only counters,
histograms and instantaneous gauges are exported; rates are PromQL's job::

    requests/s by reason
        sum by (finished_reason) (rate(vllm:request_success_total[1m]))
    generation tokens/s
        rate(vllm:generation_tokens_total[1m])
    p99 time to first token
        histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[5m])))
    mean inter-token gap
        rate(vllm:inter_token_latency_seconds_sum[1m]) / rate(vllm:inter_token_latency_seconds_count[1m])
    prefix cache hit rate (share of admitted requests' tokens found cached)
        sum(rate(vllm:prefix_cache_hits_total[5m])) / sum(rate(vllm:prefix_cache_queries_total[5m]))
    acceptance rate by method
        sum by (method) (rate(vllm:spec_decode_num_accepted_tokens_total[5m])
            * on (instance, model_name, engine) group_left (method) specserve_speculative_config_info)
        / sum by (method) (rate(vllm:spec_decode_num_draft_tokens_total[5m]) * on (...) group_left (method) ...)

Counting rules: a request with n choices counts n times (each choice is an
engine request and computes its prompt). Generation tokens are counted as they
arrive, prompt tokens when the request ends. Inter-token latency is observed
once per output token after the first: a delta carrying k tokens after a gap
of t seconds observes t/k k times, so ``_sum / _count`` is the mean time per
output token even when speculative decoding emits several tokens per step.
Prefix-cache queries and hits are tokens, counted when a request is admitted
(a preempted request counts again when it resumes), and only with prefix
caching on: its hit rate is then hits / queries.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import prometheus_client
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.core.stats import EngineSnapshot

# The *_created series double the output and carry nothing PromQL needs (vLLM drops them too).
prometheus_client.disable_created_metrics()

ENGINE = "0"  # vLLM's ``engine`` label: the data-parallel engine index; one engine per server here
REJECT_REASONS = ("queue_full", "too_many_requests", "shutting_down", "engine_dead")
FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's buckets (vllm/v1/metrics/buckets.py), so that histograms sum across vLLM and specserve replicas.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80,
                160, 640, 2560)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920,
                           7680)


@dataclass
class RequestStats:
    """Timing and counts of one engine request, as the serving layer sees its deltas."""

    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None


def _child(kind, reg: CollectorRegistry, name: str, doc: str, labels: dict[str, str], **kw):
    """A new ``kind`` metric (Counter, Gauge, Histogram) in ``reg`` labelled with the
    names of ``labels``, as its one child for their values (``kw``: e.g. ``buckets``)."""
    return kind(name, doc, list(labels), registry=reg, **kw).labels(*labels.values())


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str):
        self._snapshot = snapshot
        self._labels = (["model_name", "engine"], [model_name, ENGINE])

    def collect(self):
        snap = self._snapshot()
        names, values = self._labels
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", snap.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting),
            ("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", snap.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            yield g
        c = CounterMetricFamily("vllm:num_preemptions", "Requests preempted (KV cache full) since start.", labels=names)
        c.add_metric(values, snap.num_preemptions)
        yield c


class ServingMetrics:
    """Counters and histograms of the serving layer, plus the engine collector."""

    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        reg, vllm = self.registry, {"model_name": model_name, "engine": ENGINE}
        self._finished = Counter(
            "vllm:request_success", "Engine requests ended, by finish reason.", [*vllm, "finished_reason"], registry=reg
        )
        self._rejected = Counter(
            "specserve_request_rejected", "Requests refused before reaching the engine.", ["model_name", "reason"],
            registry=reg,
        )
        for reason in REJECT_REASONS:  # export zeros from the start, so rates exist before the first event
            self._rejected.labels(model_name, reason)
        for reason in FINISH_REASONS:
            self._finished.labels(model_name, ENGINE, reason)
        self._prompt = _child(Counter, reg, "vllm:prompt_tokens", "Prompt tokens of ended requests.", vllm)
        self._generation = _child(Counter, reg, "vllm:generation_tokens", "Generated tokens.", vllm)
        self._ttft = _child(
            Histogram, reg, "vllm:time_to_first_token_seconds", "Arrival to first output token.", vllm,
            buckets=TTFT_BUCKETS,
        )
        self._itl = _child(
            Histogram, reg, "vllm:inter_token_latency_seconds", "Gap between output tokens.", vllm, buckets=ITL_BUCKETS
        )
        self._e2e = _child(
            Histogram, reg, "vllm:e2e_request_latency_seconds", "Arrival to the end of the request.", vllm,
            buckets=REQUEST_LATENCY_BUCKETS,
        )
        reg.register(_EngineCollector(snapshot, model_name))
        self.steps: StepMetrics | None = None

    def attach_engine(self, method: str | None, num_speculative_tokens: int) -> "StepMetrics":
        """The per-step metrics of an engine; register ``.on_step`` as its stat logger."""
        self.steps = StepMetrics(self.registry, self.model_name, method or "none", num_speculative_tokens)
        return self.steps

    def on_tokens(self, stats: RequestStats, num_new: int, now: float | None = None) -> None:
        """``num_new`` output tokens of the request arrived (call before updating its counts)."""
        if num_new <= 0:
            return
        now = time.monotonic() if now is None else now
        if stats.first_token_time is None:
            stats.first_token_time = now
            self._ttft.observe(now - stats.arrival_time)
        else:
            gap = (now - stats.last_token_time) / num_new
            for _ in range(num_new):
                self._itl.observe(gap)
        stats.last_token_time = now
        stats.num_output_tokens += num_new
        self._generation.inc(num_new)

    def on_finished(self, stats: RequestStats, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._finished.labels(self.model_name, ENGINE, stats.finish_reason or "abort").inc()
        self._prompt.inc(stats.num_prompt_tokens)
        self._e2e.observe(now - stats.arrival_time)

    def on_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class StepMetrics:
    """Engine-step metrics: scheduling, prefix cache and speculative decoding. vLLM's
    names carry ``model_name`` and ``engine``; ours ``model_name`` and ``method``.
    ``on_step`` runs on the engine thread (prometheus_client is thread-safe)."""

    def __init__(self, reg: CollectorRegistry, model_name: str, method: str, num_speculative_tokens: int):
        per_model = {"model_name": model_name}
        per_method = {**per_model, "method": method}
        vllm = {**per_model, "engine": ENGINE}
        _child(Gauge, reg, "specserve_speculative_config_info",
               "The speculative method of this engine (1); 'none' without speculation.",
               {**vllm, "method": method, "num_speculative_tokens": str(num_speculative_tokens)}).set(1)

        def histogram(name, doc, buckets, labels=per_method):
            return _child(Histogram, reg, name, doc, labels, buckets=buckets)

        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduling.",
                               REQUEST_LATENCY_BUCKETS, vllm)
        self.prefill = histogram("vllm:request_prefill_time_seconds", "First scheduling to first token.",
                                 REQUEST_LATENCY_BUCKETS, vllm)
        self.step_tokens = histogram(
            "specserve_step_tokens", "Tokens computed per engine step.", STEP_TOKEN_BUCKETS, per_model
        )
        self.prefix_queries = _child(
            Counter, reg, "vllm:prefix_cache_queries", "Tokens of admitted requests looked up in the prefix cache.", vllm
        )
        self.prefix_hits = _child(
            Counter, reg, "vllm:prefix_cache_hits", "Tokens of admitted requests found in the prefix cache.", vllm
        )
        self._spec_counters(reg, vllm, per_method, num_speculative_tokens)
        rounds = tuple(range(1, num_speculative_tokens + 2))
        self.tokens_per_round = histogram(
            "specserve_spec_decode_tokens_per_round", "Tokens emitted by one drafting round (accepted + 1).", rounds
        )
        self.decode_step_time = histogram(
            "specserve_decode_step_time_seconds",
            "Duration of engine steps that computed no prompt token (decoding and verification only).",
            STEP_TIME_BUCKETS,
        )
        self.draft_time = histogram(
            "specserve_spec_decode_draft_time_seconds", "Scheduling and drafting time per decode step.", STEP_TIME_BUCKETS
        )
        self.verify_time = histogram(
            "specserve_spec_decode_verify_time_seconds", "Target pass and verification time per decode step.",
            STEP_TIME_BUCKETS,
        )
        self.paused = _child(
            Gauge, reg, "specserve_spec_decode_num_paused_requests",
            "Requests whose drafting is paused (drafts did not pay).", per_method,
        )

    def _spec_counters(self, reg, vllm: dict, per_method: dict, num_speculative_tokens: int) -> None:
        def counter(name, doc):
            return _child(Counter, reg, f"vllm:spec_decode_{name}", doc, vllm)

        self.drafts = counter("num_drafts", "Drafting rounds verified (requests x steps with drafts).")
        self.draft_tokens = counter("num_draft_tokens", "Draft tokens verified.")
        self.accepted = counter("num_accepted_tokens", "Draft tokens accepted.")
        self.fallbacks = _child(Counter, reg, "specserve_spec_decode_fallbacks",
                                "Steps in which the drafter failed and its requests decoded plainly.", per_method)
        per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = first draft).",
            [*vllm, "position"],
            registry=reg,
        )
        self.per_pos = [per_pos.labels(*vllm.values(), str(i)) for i in range(num_speculative_tokens)]

    def on_step(self, stats) -> None:
        self.step_tokens.observe(stats.num_scheduled_tokens)
        self.prefix_queries.inc(stats.num_prefix_cache_queries)
        self.prefix_hits.inc(stats.num_prefix_cache_hits)
        for queue_s, prefill_s in stats.first_token_times:
            self.queue.observe(queue_s)
            self.prefill.observe(prefill_s)
        if stats.is_decode_only:
            self.decode_step_time.observe(stats.times.step_s)
        spec = stats.spec
        if spec is None:
            return
        if stats.is_decode_only:
            self.draft_time.observe(stats.times.draft_s)
            self.verify_time.observe(stats.times.execute_s)
        self.paused.set(spec.num_paused)
        self.fallbacks.inc(spec.num_fallbacks)
        if not spec.num_drafts:
            return
        self.drafts.inc(spec.num_drafts)
        self.draft_tokens.inc(spec.num_draft_tokens)
        self.accepted.inc(spec.num_accepted_tokens)
        for counter, n in zip(self.per_pos, spec.accepted_per_pos):
            if n:
                counter.inc(n)
        for n in spec.tokens_per_round:
            self.tokens_per_round.observe(n)
