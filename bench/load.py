"""Load test of the HTTP server under mixed traffic, misbehaving clients and several drafters.

    .venv/bin/python -m bench.load [--requests 300] [--concurrency 32] [--max-tokens 8,32]
                                   [--methods none,ngram,early_exit] [--warmup-passes 2] [--max-seconds 1200]

One ``specserve serve`` process per speculation method, on 127.0.0.1, one after
the other (the CPU is not shared between them); each gets its share of the
requests (``bench.loadgen`` plans them: mixed prompt lengths, both routes,
greedy and sampled settings, per-request speculation opt-out; 10% hang up
mid-stream, 10% carry an invalid parameter), streamed at the given concurrency
after warm-up passes of the same requests. Every greedy request is then run
again alone on the same server. Bounded: a fixed number of requests, a timeout per request and a
time budget for the whole run, past which nothing new is sent.

The run fails (exit status 1) unless, for every server:
- no 5xx: no status >= 500, no error event in any stream;
- every completed stream is well formed: data lines of JSON, one finish reason
  per choice, the usage chunk, then exactly one [DONE]; usage adds up, its
  prompt tokens are the prompt's, its completion tokens fit n and max_tokens
  (and equal the tokens carrying logprobs where they were asked for);
- every invalid request gets its 4xx with the error body;
- every greedy request writes under load what it writes alone;
- afterwards nothing runs or waits and the KV-cache usage is back to 0 (the
  block pool at its initial free count);
- resident memory after the run is within RSS_TOLERANCE of before (measured
  after warm-up passes of the same requests: native memory grows over the first
  few hundred requests, mostly oneDNN's bounded cache of kernels per input
  shape, then levels off, while the number of Python objects stays flat; a
  leak grows with every request and shows all the same);
- SIGTERM drains the server and it exits with status 0.
Reports p50 / p99 time to first token, gap between output events, time per
output token, and throughput. Writes bench/results/load.md and load.png.
"""

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from bench.common import RESULTS, markdown_table, write_report
from bench.loadgen import (
    check_greedy,
    check_rejected,
    check_stream,
    latencies,
    make_plan,
    percentiles,
    run_alone,
    run_load,
    usage,
)
from bench.server_procs import free_port, metric, scrape

METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "early_exit": {"method": "early_exit", "num_speculative_tokens": 3, "num_layers": 8},
}
RSS_TOLERANCE = 0.05
REQUEST_TIMEOUT = 120.0


def expected_prompt_tokens(tokenizer, job) -> int:
    """What the server counts: the prompt's tokens, or the chat template's rendering."""
    if job.route == "chat":
        text = tokenizer.apply_chat_template(job.body["messages"], add_generation_prompt=True, tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False))
    return len(tokenizer.encode(job.prompt, add_special_tokens=False))


def engine_idle(url: str, timeout: float = 60.0) -> tuple[bool, dict]:
    """Waits until nothing runs or waits and no KV block is in use; (idle, last readings)."""
    deadline = time.monotonic() + timeout
    while True:
        s = scrape(url)
        seen = {
            "running": metric(s, "vllm:num_requests_running"),
            "waiting": metric(s, "vllm:num_requests_waiting"),
            "kv_usage": metric(s, "vllm:kv_cache_usage_perc"),
        }
        if not any(seen.values()) or time.monotonic() > deadline:
            return not any(seen.values()), seen
        time.sleep(0.2)


@dataclass
class ServerRun:
    """What one server did and what was checked."""

    method: str
    results: list = field(default_factory=list)
    wall_s: float = 0.0
    problems: dict[str, list[str]] = field(default_factory=dict)  # check name -> failures
    counts: dict[str, int] = field(default_factory=dict)
    rss_warmup: list[int] = field(default_factory=list)  # at start, after the warm-up
    rss_before: int = 0
    rss_after: int = 0
    exit_code: int | None = None

    def fail(self, check: str, problem: str) -> None:
        self.problems.setdefault(check, []).append(problem)


class ServerProcess:
    """``specserve serve`` on a free loopback port; ``stop()`` sends SIGTERM and returns the exit status."""

    def __init__(self, spec: dict | None, log: Path, max_model_len: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(512 << 20),
            "--log-level", "warning", "--shutdown-timeout", "30",
        ]  # fmt: skip
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.ps = psutil.Process(self.proc.pid)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.5)

    def rss(self) -> int:
        return self.ps.memory_info().rss

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None


def check_run(run: ServerRun, alone: dict, tokenizer) -> None:
    """Fills ``run.problems`` and ``run.counts`` from the results (see the module doc)."""
    c = run.counts
    for res in run.results:
        job = res.job
        c[job.kind] = c.get(job.kind, 0) + 1
        if res.error and res.error.startswith("not sent"):
            c["not sent"] = c.get("not sent", 0) + 1
            continue
        error_event = res.status == 200 and any(isinstance(e, dict) and "error" in e for e in res.events)
        server_errors = res.status >= 500 or error_event
        if server_errors:
            run.fail("no 5xx", f"job {job.id}: status {res.status} {str(res.events)[-300:]}")
        if job.kind == "invalid":
            for p in check_rejected(res):
                run.fail("invalid -> 4xx", f"job {job.id}: {p}")
        elif job.kind == "disconnect":
            if res.status != 200 or res.error:
                run.fail("disconnects", f"job {job.id}: status {res.status} {res.error}")
        else:
            for p in check_stream(res, expected_prompt_tokens(tokenizer, job)):
                run.fail("streams well formed", f"job {job.id}: {p}")
            c["tokens"] = c.get("tokens", 0) + ((usage(res) or {}).get("completion_tokens") or 0)
            if job.greedy:
                c["greedy"] = c.get("greedy", 0) + 1
                if job.id not in alone:
                    c["greedy unchecked"] = c.get("greedy unchecked", 0) + 1
                    continue
                for p in check_greedy(res, alone[job.id]):
                    run.fail("greedy = alone", f"job {job.id}: {p}")


def run_server(method: str, jobs: list, args, tokenizer, budget_end: float, log: Path) -> ServerRun:
    run = ServerRun(method)
    server = ServerProcess(METHODS[method], log, args.max_model_len)
    try:
        server.wait_ready()
        start = time.monotonic()
        run.rss_warmup = warm_up(server, jobs, args, start + 0.4 * (budget_end - start))
        idle, seen = engine_idle(server.url)
        if not idle:
            run.fail("blocks back", f"not idle after the warm-up: {seen}")
        run.rss_before = server.rss()
        t0 = time.perf_counter()
        left = max(1.0, budget_end - time.monotonic())
        run.results = asyncio.run(run_load(server.url, jobs, args.concurrency, REQUEST_TIMEOUT, deadline=left))
        run.wall_s = time.perf_counter() - t0
        idle, seen = engine_idle(server.url)
        if not idle:
            run.fail("blocks back", f"engine not idle after the run: {seen}")
        run.rss_after = server.rss()
        if abs(run.rss_after - run.rss_before) > RSS_TOLERANCE * run.rss_before:
            run.fail("memory", f"RSS {run.rss_before >> 20} MiB -> {run.rss_after >> 20} MiB")
        done = {r.job.id for r in run.results if r.status == 200 and not r.error}
        greedy = [j for j in jobs if j.greedy and j.id in done]
        alone = asyncio.run(_alone_within(server.url, greedy, budget_end))
        check_run(run, alone, tokenizer)
    finally:
        run.exit_code = server.stop()
    if run.exit_code != 0:
        run.fail("SIGTERM -> exit 0", f"exit status {run.exit_code}")
    return run


def warm_up(server: ServerProcess, jobs: list, args, end: float) -> list[int]:
    """The same requests ``--warmup-passes`` times before the measured run (results
    dropped), none started after ``end``. Native memory grows over the first few
    hundred requests, mostly oneDNN's cache of kernels per input shape (bounded:
    1024 kernels by default; with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 the RSS stays
    flat), then levels off; a leak, growing with every request, shows in the
    measured run all the same. Returns the RSS at start and after each pass."""
    trace = [server.rss()]
    for _ in range(args.warmup_passes):
        left = end - time.monotonic()
        if left <= 0:
            break
        asyncio.run(run_load(server.url, jobs, args.concurrency, REQUEST_TIMEOUT, deadline=left))
        engine_idle(server.url)
        trace.append(server.rss())
    return trace


async def _alone_within(url: str, jobs: list, budget_end: float) -> dict:
    out = {}
    for job in jobs:
        if time.monotonic() > budget_end:
            break
        out.update(await run_alone(url, [job], REQUEST_TIMEOUT))
    return out


CHECKS = ["no 5xx", "streams well formed", "invalid -> 4xx", "disconnects", "greedy = alone", "blocks back", "memory",
          "SIGTERM -> exit 0"]  # fmt: skip


def report(runs: list[ServerRun], args, total_s: float) -> tuple[str, bool]:
    header = ["server", "requests", "ok", "disconnect", "invalid", "greedy checked", "tok/s", "req/s",
              "TTFT p50 / p99 s", "ITL p50 / p99 ms", "TPOT p50 / p99 ms", "RSS MiB warm-up",
              "RSS MiB before / after"]  # fmt: skip
    rows = []
    for r in runs:
        lat = latencies(r.results)
        ttft, itl, tpot = (percentiles(lat[k]) for k in ("ttft", "itl", "tpot"))
        c = r.counts
        rows.append([
            r.method, len(r.results), c.get("normal", 0), c.get("disconnect", 0), c.get("invalid", 0),
            f"{c.get('greedy', 0) - c.get('greedy unchecked', 0)} / {c.get('greedy', 0)}",
            c.get("tokens", 0) / r.wall_s if r.wall_s else 0.0, len(r.results) / r.wall_s if r.wall_s else 0.0,
            f"{ttft[0]:.2f} / {ttft[1]:.2f}", f"{itl[0] * 1e3:.0f} / {itl[1] * 1e3:.0f}",
            f"{tpot[0] * 1e3:.0f} / {tpot[1] * 1e3:.0f}", " > ".join(str(x >> 20) for x in r.rss_warmup),
            f"{r.rss_before >> 20} / {r.rss_after >> 20}",
        ])  # fmt: skip
    checks = [[name] + ["pass" if name not in r.problems else f"FAIL ({len(r.problems[name])})" for r in runs]
              for name in CHECKS]  # fmt: skip
    ok = all(not r.problems for r in runs)
    failures = "\n".join(f"- {r.method} / {name}: {p}" for r in runs for name, ps in r.problems.items() for p in ps[:5])
    body = (
        f"{sum(len(r.results) for r in runs)} streamed requests at concurrency {args.concurrency} "
        f"(max_tokens {args.max_tokens[0]}-{args.max_tokens[1]}), one server per speculation method, "
        f"{total_s:.0f} s in all. Result: **{'PASS' if ok else 'FAIL'}**.\n\n"
        + markdown_table(header, rows)
        + "\n\nTTFT: request sent to first output event. ITL: gap between output events (several tokens "
        "when drafts are accepted). TPOT: (last - first output event) / (tokens per choice - 1). "
        "tok/s: completion tokens of the completed requests over the load phase. RSS warm-up: the server's "
        f"RSS at start and after each of {args.warmup_passes} warm-up passes of the same requests; before / after: "
        "around the measured run.\n\n"
        + markdown_table(["check"] + [r.method for r in runs], checks)
        + (f"\n\nFailures (first five per check):\n\n{failures}" if failures else "")
        + "\n\n![latencies](load.png)"
    )
    return body, ok


def plot(runs: list[ServerRun], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        lat = latencies(r.results)
        axes[0].hist(lat["ttft"], bins=30, histtype="step", label=r.method)
        axes[1].hist([x * 1e3 for x in lat["itl"]], bins=40, histtype="step", label=r.method)
    axes[0].set(title="time to first token", xlabel="s", ylabel="requests")
    axes[1].set(title="gap between output events", xlabel="ms", ylabel="gaps", yscale="log")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", default="8,32", help="lo,hi: max_tokens is drawn in this range")
    ap.add_argument("--methods", default="none,ngram,early_exit")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-seconds", type=float, default=1200, help="time budget; nothing new is sent past it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-passes", type=int, default=2, help="passes of the same requests before measuring")
    args = ap.parse_args(argv)
    args.max_tokens = tuple(int(x) for x in args.max_tokens.split(","))
    methods = args.methods.split(",")
    from transformers import AutoTokenizer

    from engine.worker.model_store import fetch_default_model

    tokenizer = AutoTokenizer.from_pretrained(fetch_default_model())
    jobs = make_plan(args.requests, args.seed, args.max_tokens)
    RESULTS.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    t0, runs = time.monotonic(), []
    for i, method in enumerate(methods):
        share = jobs[i :: len(methods)]  # each server its slice of the budget
        budget_end = t0 + args.max_seconds * (i + 1) / len(methods)
        runs.append(run_server(method, share, args, tokenizer, budget_end, RESULTS / f"load-server-{method}.log"))
        print(f"{method}: {len(share)} requests, problems: {list(runs[-1].problems) or 'none'}", flush=True)
    body, ok = report(runs, args, time.monotonic() - t0)
    body += (
        f"\n\nMachine load average (1 min) {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end: "
        "above 0 at the start means other work shared the cores: the throughput above is then a lower bound and "
        "the latencies upper bounds."
    )
    plot(runs, RESULTS / "load.png")
    command = "python -m bench.load " + " ".join(argv if argv is not None else sys.argv[1:])
    path = write_report("load", "Load test: mixed traffic, misbehaving clients, three drafters", body, command.strip())
    print(body)
    print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
