"""Speculation under load: plain decoding against each drafter, concurrency 1 to 64.

    .venv/bin/python -m bench.load_sweep [--methods ngram] [--concurrency 1,2,4,8,16,32,64] [--rounds 3]
        [--requests-per-worker 3] [--max-tokens 128] [--fixed-length]

Every server (plain, and one per speculation method) is up at once. For each
concurrency ``c``, a wave of ``c * --requests-per-worker`` streamed chat requests
(greedy, ``ignore_eos``, MT-Bench-style prompts, each with its own output length
around ``--max-tokens`` (``output_lengths``); the same requests for every server)
is sent by ``c`` workers, each sending the next request of one shared queue as
soon as its last one ended (vLLM's ``--max-concurrency``: the batch stays full
until the wave's tail, as under steady load), to each server in turn (the
order rotated each round), ``--rounds`` times, so that the machine's
drifting speed hits every server alike; measured from the client:
total output tokens/s (median over rounds), and per request the inter-token
latency (gap between output events over the tokens they carried, p50 over
every round) and the time per output token; from each server's ``/metrics``, the
draft tokens per 100 output tokens and the share accepted. The target: with speculation on,
throughput and p50 latency never worse than off beyond noise (0.97x) at any
concurrency. Writes bench/results/load_sweep.md and load_sweep.png.
"""

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from bench.common import RESULTS, markdown_table, rotated, round_robin_chat, write_report
from bench.server_procs import metric, scrape, serve
from bench.sse_client import chat_body, stream_chat

METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 8},
    "early_exit": {"method": "early_exit", "num_speculative_tokens": 4},
    "suffix": {"method": "suffix"},  # vLLM's defaults (docs/speculation.md)
}
FLOOR = 0.97  # speculation on / off below this is a loss


async def one(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed request: output tokens, and per-token gaps between output events."""
    r = await stream_chat(url, chat_body(prompt, max_tokens, ignore_eos=True))
    times, tokens = r.event_times, r.tokens
    gaps = [b - a for a, b in zip(times, times[1:])]
    events = max(1, len(times) - 1)
    tpot = (times[-1] - times[0]) / max(1, tokens - 1) if len(times) > 1 else 0.0
    # An event carries tokens / events tokens on average: the latency per token of each gap.
    return {"tokens": tokens, "itl": [g * events / max(1, tokens - 1) for g in gaps], "tpot": tpot}


async def wave(url: str, requests: list[tuple[str, int]], concurrency: int) -> dict:
    """``requests`` (prompt, max tokens) through ``concurrency`` workers, each taking the
    next request of one shared queue, in order, as soon as its last one ended (vLLM's
    ``--max-concurrency``, a semaphore over requests sent in order): total tokens/s,
    every per-token gap, each request's TPOT. (Workers with prompts dealt out in
    advance, ``prompts[i::c]``, made the wall time that of the worker whose prompts sped
    up least: with the categories in turn, at 8 workers one got every extraction prompt
    and another every writing one.)"""
    results, queue = [], list(reversed(requests))

    async def worker() -> None:
        while queue:
            results.append(await one(url, *queue.pop()))

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t
    return {"tok_s": sum(r["tokens"] for r in results) / wall, "tokens": sum(r["tokens"] for r in results),
            "itl": [g for r in results for g in r["itl"]], "tpot": [r["tpot"] for r in results]}


def drafts_so_far(url: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) the server has verified since it started (/metrics)."""
    s = scrape(url)
    return (metric(s, "vllm:spec_decode_num_draft_tokens_total"),
            metric(s, "vllm:spec_decode_num_accepted_tokens_total"))


def summarize(waves: list[dict]) -> dict:
    """The rounds of one server at one concurrency: median throughput, p50 over all gaps,
    draft tokens per 100 output tokens and the share of them accepted."""
    itl = [g for w in waves for g in w["itl"]]
    drafted, accepted = sum(w["drafted"] for w in waves), sum(w["accepted"] for w in waves)
    return {
        "tok_s": statistics.median(w["tok_s"] for w in waves),
        "itl_p50_ms": 1000 * statistics.median(itl) if itl else 0.0,
        "tpot_p50_ms": 1000 * statistics.median(t for w in waves for t in w["tpot"]),
        "drafts_per_100": 100 * drafted / max(1, sum(w["tokens"] for w in waves)),
        "accepted_pct": 100 * accepted / drafted if drafted else 0.0,
    }


def sweep(urls: dict[str, str], levels: list[int], requests: list[tuple[str, int]], rounds: int,
          per_worker: int) -> dict:
    """Each concurrency, each round: one wave to each server in turn, the order rotated
    each round (``bench.common.rotated``)."""
    for url in urls.values():
        asyncio.run(wave(url, [(p, 8) for p, _ in requests[:2]], 2))  # warm-up
    out = {name: {} for name in urls}
    for c in levels:
        waves = {name: [] for name in urls}
        for r in range(rounds):
            for name, url in rotated(list(urls.items()), r):  # each server takes each place in turn
                before = drafts_so_far(url)
                w = asyncio.run(wave(url, requests[: c * per_worker], c))
                after = drafts_so_far(url)
                waves[name].append({**w, "drafted": after[0] - before[0], "accepted": after[1] - before[1]})
        for name in urls:
            r = out[name][c] = summarize(waves[name])
            print(f"[{name}] c={c}: {r['tok_s']:.1f} tok/s, ITL p50 {r['itl_p50_ms']:.0f} ms, "
                  f"TPOT p50 {r['tpot_p50_ms']:.0f} ms, {r['drafts_per_100']:.1f} drafts per 100 tokens, "
                  f"{r['accepted_pct']:.0f}% accepted", flush=True)
    return out


def output_lengths(n: int, mean: int, fixed: bool) -> list[int]:
    """Each request's ``max_tokens``: uniform over ``mean / 2 .. 3 mean / 2`` from a seeded
    generator (the same for every server), or ``mean`` for all when ``fixed``.

    Real traffic asks for outputs of many lengths (vLLM's serving benchmark takes each
    request's from its dataset). Lengths all equal make plain decoding's requests of a
    wave finish in lock-step, with no tail at low batch, while speculation's, some
    faster than others, do not: a wave would then measure that spread, not the
    steady state."""
    if fixed:
        return [mean] * n
    rng = random.Random(0)
    return [rng.randint(mean // 2, mean + mean // 2) for _ in range(n)]


def report(results: dict, levels: list[int], command: str, max_tokens: int, per_worker: int, fixed: bool) -> None:
    header = ["concurrency", "plain tok/s", "plain ITL p50 ms"]
    methods = [m for m in results if m != "plain"]
    for m in methods:
        header += [f"{m} tok/s", f"{m} / plain", f"{m} ITL p50 ms", f"{m} ITL plain / {m}",
                   f"{m} drafts / 100 tokens", f"{m} accepted %"]
    rows, worst = [], {}
    for c in levels:
        p = results["plain"][c]
        row = [c, p["tok_s"], p["itl_p50_ms"]]
        for m in methods:
            r = results[m][c]
            ratio, itl_ratio = r["tok_s"] / p["tok_s"], p["itl_p50_ms"] / max(r["itl_p50_ms"], 1e-9)
            worst[m] = min(worst.get(m, 9.0), ratio, itl_ratio)
            row += [r["tok_s"], ratio, r["itl_p50_ms"], itl_ratio, r["drafts_per_100"], r["accepted_pct"]]
        rows.append(row)
    body = markdown_table(header, rows)
    for m in methods:
        verdict = "PASS" if worst[m] >= FLOOR else "FAIL"
        body += f"\n\n{m}: worst ratio to plain (throughput or p50 ITL) {worst[m]:.2f} -> **{verdict}** (floor {FLOOR})"
    lengths = (f"{max_tokens}" if fixed
               else f"{max_tokens // 2}-{max_tokens + max_tokens // 2} (seeded, the same for every server)")
    body += (f"\n\nEach concurrency c: a wave of {per_worker} c streamed chat requests, greedy, {lengths} "
             "tokens each with ignore_eos, sent by c workers that each send the next request of one shared queue as "
             "soon as their last one ended (vLLM's --max-concurrency), to every server in turn (all up at once; "
             "the order rotated each round), in rounds; "
             "throughput is the median over rounds. ITL: the gap between output events divided by the tokens "
             "they carried, p50 over all gaps of the wave. Ratios above 1 mean speculation on is better. "
             "Drafts and acceptance: the server's /metrics over all rounds at that concurrency (no drafts: the "
             "server ran plain decoding's code plus planning, and its ratio to plain is this machine's noise). "
             "Client: bench.sse_client.\n\n![sweep](load_sweep.png)")
    write_report("load_sweep", "Speculation under load: concurrency sweep against plain decoding", body, command)
    plot(results, levels)


def plot(results: dict, levels: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, res in results.items():
        a.plot(levels, [res[c]["tok_s"] for c in levels], "o-", label=name)
        b.plot(levels, [res[c]["itl_p50_ms"] for c in levels], "o-", label=name)
    for ax, label in ((a, "output tokens/s"), (b, "p50 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "load_sweep.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="ngram", help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--max-tokens", type=int, default=128, help="mean output length of a request")
    ap.add_argument("--fixed-length", action="store_true", help="every request exactly --max-tokens")
    ap.add_argument("--rounds", type=int, default=3, help="waves per server and concurrency, interleaved")
    ap.add_argument("--requests-per-worker", type=int, default=3,
                    help="requests each of the c workers sends back to back in a wave")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    n = max(levels) * args.requests_per_worker
    pool = round_robin_chat(n)  # 80 MT-Bench-style prompts: a wave of more repeats them
    prompts = (pool * -(-n // len(pool)))[:n]
    requests = list(zip(prompts, output_lengths(n, args.max_tokens, args.fixed_length)))
    methods = [m for m in args.methods.split(",") if m]
    configs = {"plain": [], **{m: ["--speculative-config", json.dumps(METHODS[m])] for m in methods}}
    with ExitStack() as stack:
        urls = {name: stack.enter_context(serve(["--max-model-len", "2048", *extra], _log(name)))
                for name, extra in configs.items()}
        results = sweep(urls, levels, requests, args.rounds, args.requests_per_worker)
    command = (f"python -m bench.load_sweep --methods {args.methods} --concurrency {args.concurrency} "
               f"--rounds {args.rounds} --requests-per-worker {args.requests_per_worker}")
    command += f" --max-tokens {args.max_tokens}" if args.max_tokens != 128 else ""
    command += " --fixed-length" if args.fixed_length else ""
    report(results, levels, command, args.max_tokens, args.requests_per_worker, args.fixed_length)


def _log(name: str) -> str:
    return str(Path(tempfile.gettempdir()) / f"specserve-sweep-{name}.log")


if __name__ == "__main__":
    main()
