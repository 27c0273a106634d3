"""GET /metrics: Prometheus text with the serving metrics, counted as documented."""

from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL


def scrape(server) -> dict[str, dict]:
    """name -> {labels tuple: value} for every sample."""
    with server.http() as http:
        r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def value(samples, name, **labels) -> float:
    """A sample of ``name`` by its labels; vLLM's names carry ``engine`` too."""
    base = {"model_name": MODEL, "engine": "0"} if name.startswith("vllm:") else {"model_name": MODEL}
    return samples.get(name, {}).get(tuple(sorted({**base, **labels}.items())), 0.0)


def test_names_and_families(server):
    samples = scrape(server)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "specserve_request_rejected_total",
    ):
        assert name in samples, name
    assert all(n.startswith(("vllm:", "specserve_")) for n in samples)
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.0


def test_counts_follow_requests(server):
    before = scrape(server)
    client = server.client()
    r = client.completions.create(model=MODEL, prompt="Hello there", n=2, max_tokens=4, temperature=0)
    c = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, stop=["zzz"]
    )
    after = scrape(server)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:generation_tokens_total") == r.usage.completion_tokens + c.usage.completion_tokens == 11
    # each choice computes its prompt: n=2 counts the completion prompt twice
    assert delta("vllm:prompt_tokens_total") == 2 * r.usage.prompt_tokens + c.usage.prompt_tokens
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 11 - 3  # every token after each first
    assert delta("vllm:time_to_first_token_seconds_sum") > 0


def test_queue_full_is_counted_as_rejected(server, monkeypatch):
    monkeypatch.setattr(server.serving, "pending", server.settings.max_waiting)
    with server.http() as http:
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 503
    monkeypatch.undo()
    assert value(scrape(server), "specserve_request_rejected_total", reason="queue_full") == 1


def test_prefix_cache_counts_queried_and_hit_tokens(server):
    """The same prompt twice, one after the other: the second finds every full block
    before its last token cached (tokens, counted at admission)."""
    before = scrape(server)
    client = server.client()
    prompt = "Name three rivers of Europe, say in which sea each one ends, and give the length of each in kilometres."
    usages = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0).usage for _ in range(2)]
    after = scrape(server)
    queried = value(after, "vllm:prefix_cache_queries_total") - value(before, "vllm:prefix_cache_queries_total")
    hit = value(after, "vllm:prefix_cache_hits_total") - value(before, "vllm:prefix_cache_hits_total")
    p = usages[0].prompt_tokens
    assert p > 16 and queried == 2 * p
    assert 16 * ((p - 1) // 16) <= hit <= queried
