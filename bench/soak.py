"""Mixed traffic for an hour (by default) at 32 concurrent: nothing lost, leaked or drifting.

    .venv/bin/python -m bench soak [--seconds 3600] [--warmup 300] [--window 300] [--concurrency 32]
                                   [--method ngram] [--max-tokens 8,48]

One ``specserve serve`` (the default model, the given speculation method) on
127.0.0.1. Workers keep ``--concurrency`` requests in flight until the time is
up, drawn from ``bench.loadgen``'s mix (both routes, greedy and seeded sampling,
n = 2, logprobs, stop strings, speculation off per request, 10% clients that
hang up mid-stream, 10% invalid requests) with a fifth answered in one JSON
body instead of a stream, and chat requests with a JSON schema or tools. Then
it drains: every request in flight is answered or times out, and the engine
must be idle with its KV cache empty.

The run fails (exit status 1) unless
- no answer has a status >= 500 or an error event;
- nothing is lost: every request sent gets its answer (a transport error or a
  timeout counts as lost; a client that hangs up on purpose does not);
- no KV block is held after the drain;
- resident memory grows by at most 5% from the end of the warm-up to the end;
- the p99 gap between output events in the last window is within 10% of the
  first window after the warm-up.
Writes bench/results/soak.md (a row per window) and soak.png.
"""

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from bench.common import RESULTS, markdown_table, write_report
from bench.load import REQUEST_TIMEOUT, ServerProcess, engine_idle
from bench.loadgen import Result, check_rejected, check_stream, latencies, make_plan, percentiles, send

RSS_GROWTH = 0.05
ITL_DRIFT = 0.10
RSS_EVERY_S = 10.0
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "count"], "additionalProperties": False}  # fmt: skip
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}  # fmt: skip


def jobs_forever(seed: int, max_tokens: tuple[int, int]):
    """``bench.loadgen``'s plan, batch after batch, with answers in one body, schemas and tools mixed in."""
    rng, next_id = random.Random(seed), 0
    for batch in range(sys.maxsize):
        for job in make_plan(100, seed * 100_000 + batch, max_tokens):
            job.id, next_id = next_id, next_id + 1
            r = rng.random()
            if job.kind == "normal" and r < 0.2:
                job.body["stream"] = False
                job.body.pop("stream_options", None)
            elif job.kind == "normal" and job.route == "chat" and r < 0.3:
                if r < 0.25:
                    job.body["response_format"] = {"type": "json_schema",
                                                   "json_schema": {"name": "item", "schema": SCHEMA}}  # fmt: skip
                else:
                    job.body.update(tools=[TOOL], tool_choice=rng.choice(["auto", "required"]))
                job.body["max_tokens"] = max(job.body["max_tokens"], 40)
            yield job


@dataclass
class Soak:
    results: list[Result] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)
    idle: bool = False
    idle_readings: dict = field(default_factory=dict)
    problems: dict[str, list[str]] = field(default_factory=dict)

    def fail(self, check: str, problem: str) -> None:
        self.problems.setdefault(check, []).append(problem)


async def drive(server: ServerProcess, args, soak: Soak, t0: float) -> None:
    """Keeps ``args.concurrency`` requests in flight until ``args.seconds`` have passed; then waits for them."""
    jobs = jobs_forever(args.seed, args.max_tokens)
    stop_at = t0 + args.seconds
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)

    async def worker(client: httpx.AsyncClient) -> None:
        while time.perf_counter() < stop_at:
            soak.results.append(await send(client, next(jobs), REQUEST_TIMEOUT))

    async def sample_rss() -> None:
        while time.perf_counter() < stop_at:
            soak.rss.append((time.perf_counter() - t0, server.rss()))
            await asyncio.sleep(RSS_EVERY_S)

    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=REQUEST_TIMEOUT) as client:
        await asyncio.gather(sample_rss(), *(worker(client) for _ in range(args.concurrency)))
    soak.rss.append((time.perf_counter() - t0, server.rss()))


def check_answer(res: Result) -> list[str]:
    """Why an answer is wrong ([] when it is right); a deliberate hang-up only needs its 200."""
    job = res.job
    if job.kind == "invalid":
        return check_rejected(res)
    if job.kind == "disconnect":
        return [] if res.status == 200 and not res.error else [f"status {res.status} {res.error or ''}"]
    if job.body.get("stream") is not False:
        return check_stream(res, None)
    body = res.events[0] if res.events else {}
    if res.error or res.status != 200:
        return [f"status {res.status} {res.error or ''} {str(body)[:200]}"]
    choices = body.get("choices") or []
    if sorted(c["index"] for c in choices) != list(range(job.n)) or not all(c.get("finish_reason") for c in choices):
        return [f"choices {str(choices)[:200]}"]
    return [] if body.get("usage", {}).get("completion_tokens") else ["no usage"]


def windows(soak: Soak, args, t0: float) -> list[dict]:
    """Per window of ``args.window`` seconds (by when the answers ended): counts, latencies, memory."""
    out = []
    for start in range(0, int(args.seconds), int(args.window)):
        end = start + args.window
        done = [r for r in soak.results if start <= r.t_end - t0 < end]
        rss = [b for t, b in soak.rss if start <= t < end] or [0]
        lat = latencies(done)
        out.append({"start": start, "end": end, "answered": len(done),
                    "5xx": sum(r.status >= 500 for r in done), "lost": sum(bool(r.error) for r in done),
                    "itl": percentiles(lat["itl"]), "ttft": percentiles(lat["ttft"]), "rss": max(rss)})  # fmt: skip
    return out


def judge(soak: Soak, rows: list[dict], args) -> dict[str, str]:
    """Each check's verdict, filling ``soak.problems``."""
    for res in soak.results:
        if res.status >= 500 or any(isinstance(e, dict) and "error" in e for e in res.events if res.status == 200):
            soak.fail("no 5xx", f"job {res.job.id}: status {res.status} {str(res.events)[:160]}")
        elif res.error and res.job.kind != "disconnect":
            soak.fail("nothing lost", f"job {res.job.id}: {res.error}")
        elif problems := check_answer(res):
            soak.fail("answers well formed", f"job {res.job.id}: {problems[0][:200]}")
    if not soak.idle:
        soak.fail("no KV blocks leaked", f"after the drain: {soak.idle_readings}")
    measured = [r for r in rows if r["start"] >= args.warmup and r["answered"]]
    verdicts = {}
    if len(measured) >= 2:
        growth = measured[-1]["rss"] / measured[0]["rss"] - 1
        drift = measured[-1]["itl"][1] / measured[0]["itl"][1] - 1
        verdicts = {"RSS growth after warm-up": f"{growth:+.1%}", "p99 ITL drift": f"{drift:+.1%}"}
        if growth > RSS_GROWTH:
            soak.fail("RSS growth <= 5%", f"{growth:+.1%}")
        if drift > ITL_DRIFT:
            soak.fail("p99 ITL drift <= 10%", f"{drift:+.1%}")
    else:
        soak.fail("enough windows", "fewer than two windows after the warm-up: lengthen --seconds")
    return verdicts


def report(soak: Soak, rows: list[dict], verdicts: dict, args) -> str:
    table = markdown_table(
        ["window s", "answered", "5xx", "lost", "ITL p50 / p99 ms", "TTFT p50 / p99 s", "RSS MiB"],
        [[f"{r['start']}-{r['end']}" + (" (warm-up)" if r["start"] < args.warmup else ""), r["answered"], r["5xx"],
          r["lost"], f"{r['itl'][0] * 1e3:.0f} / {r['itl'][1] * 1e3:.0f}",
          f"{r['ttft'][0]:.2f} / {r['ttft'][1]:.2f}", r["rss"] >> 20] for r in rows])  # fmt: skip
    kinds = {k: sum(r.job.kind == k for r in soak.results) for k in ("normal", "disconnect", "invalid")}
    unstreamed = sum(r.job.body.get("stream") is False for r in soak.results)
    checks = ["no 5xx", "nothing lost", "answers well formed", "no KV blocks leaked", "RSS growth <= 5%",
              "p99 ITL drift <= 10%", "enough windows"]  # fmt: skip
    verdict_rows = [[c, "FAIL: " + "; ".join(soak.problems[c][:3]) if c in soak.problems else "pass"] for c in checks]
    return (
        f"{len(soak.results)} requests over {args.seconds:.0f} s at {args.concurrency} concurrent, speculation "
        f"`{args.method}`: {kinds['normal']} normal ({unstreamed} answered in one body), {kinds['disconnect']} "
        f"hung up mid-stream, {kinds['invalid']} invalid. Result: **{'FAIL' if soak.problems else 'PASS'}**.\n\n"
        + table + "\n\n" + markdown_table(["check", "verdict"], verdict_rows)
        + "\n\n" + "\n".join(f"- {k}: {v} (first window after the warm-up to the last)" for k, v in verdicts.items())
        + "\n\n![soak](soak.png)"
    )


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mid = [(r["start"] + r["end"]) / 60 / 2 for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot(mid, [r["rss"] / 2**20 for r in rows], marker="o")
    axes[0].set(title="server resident memory", xlabel="minutes", ylabel="MiB")
    axes[1].plot(mid, [r["itl"][1] * 1e3 for r in rows], marker="o", label="p99")
    axes[1].plot(mid, [r["itl"][0] * 1e3 for r in rows], marker="o", label="p50")
    axes[1].set(title="gap between output events", xlabel="minutes", ylabel="ms")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=3600)
    ap.add_argument("--warmup", type=float, default=300, help="seconds before memory and latency are compared")
    ap.add_argument("--window", type=float, default=300, help="seconds per row of the report")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--method", default="ngram", help="a speculation method of bench.load, or none")
    ap.add_argument("--max-tokens", default="8,48", help="lo,hi: max_tokens is drawn in this range")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.max_tokens = tuple(int(x) for x in args.max_tokens.split(","))
    return args


def run(args, log) -> tuple[Soak, list[dict], dict]:
    """The soak against a server of its own (its output in ``log``): what happened, the windows, the verdicts."""
    from bench.load import METHODS

    server = ServerProcess(METHODS[args.method], log, args.max_model_len)
    soak = Soak()
    try:
        server.wait_ready()
        t0 = time.perf_counter()
        asyncio.run(drive(server, args, soak, t0))
        soak.idle, soak.idle_readings = engine_idle(server.url)
    finally:
        exit_code = server.stop()
    rows = windows(soak, args, t0)
    verdicts = judge(soak, rows, args)
    if exit_code != 0:
        soak.fail("nothing lost", f"the server exited with {exit_code} on SIGTERM")
    return soak, rows, verdicts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    RESULTS.mkdir(parents=True, exist_ok=True)
    soak, rows, verdicts = run(args, RESULTS / "soak-server.log")
    plot(rows, RESULTS / "soak.png")
    body = report(soak, rows, verdicts, args)
    command = "python -m bench soak " + " ".join(argv if argv is not None else sys.argv[1:])
    path = write_report("soak", "Soak: mixed traffic for an hour, nothing lost, leaked or drifting", body,
                        command.strip())
    print(body)
    print(f"wrote {path}")
    return 1 if soak.problems else 0


if __name__ == "__main__":
    sys.exit(main())
