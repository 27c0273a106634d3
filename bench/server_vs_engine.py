"""What the HTTP server costs: the same requests through the offline engine and through the API.

    .venv/bin/python -m bench.server_vs_engine [--repeats 3]

Batch 1 (one chat prompt, greedy, 128 new tokens with ``ignore_eos``, prompt
processing included), 16 and 64 concurrent requests (as many chat prompts), each run
alternately in this process's offline engine (``engine.LLM``) and through a
``specserve serve`` subprocess's streamed ``/v1/chat/completions``, with the
same model, settings and OpenMP runtime: once with the engine core in its own
process (the default) and once on a thread of the server's process
(``--disable-frontend-multiprocessing``). The client shares the machine: it is
``bench.sse_client`` (asyncio streams, one thread), whose CPU seconds per run are
reported beside the rates. The target: the server at least 98% of the engine's
tokens/s. Writes bench/results/server_vs_engine.md.
"""

import sys

from server import openmp

if __name__ == "__main__":  # the same OpenMP runtime as the server subprocess, before torch loads
    openmp.ensure("bench.server_vs_engine", sys.argv[1:])

import argparse
import asyncio
import contextlib
import resource
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import chat_prompts, markdown_table, render_chat, write_report
from bench.server_procs import serve
from bench.sse_client import chat_body, stream_chat
from engine import LLM, SamplingParams

MAX_TOKENS = 128
TARGET = 0.98
SERVERS = {"core process": [], "engine thread": ["--disable-frontend-multiprocessing"]}


def offline(llm: LLM, prompts: list[str]) -> float:
    """Total tokens/s of the prompts as one offline batch."""
    ids = [render_chat(llm.tokenizer, p) for p in prompts]
    t = time.perf_counter()
    outs = llm.generate(ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def served(url: str, prompts: list[str]) -> tuple[float, float]:
    """Total tokens/s of the prompts sent at once, streamed, and the client's CPU seconds."""

    async def run():
        return await asyncio.gather(*(stream_chat(url, chat_body(p, MAX_TOKENS, ignore_eos=True)) for p in prompts))

    cpu = _cpu_s()
    t = time.perf_counter()
    results = asyncio.run(run())
    wall = time.perf_counter() - t
    return sum(r.tokens for r in results) / wall, _cpu_s() - cpu


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    llm = LLM(max_model_len=2048)
    loads = {"batch 1": chat_prompts(1), "16 concurrent": chat_prompts(16), "64 concurrent": chat_prompts(64)}
    rates: dict[tuple[str, str], list[float]] = {}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(serve(["--max-model-len", "2048", *flags],
                                                str(Path(tempfile.gettempdir()) / f"specserve-sve-{i}.log")))
                for i, (name, flags) in enumerate(SERVERS.items())}
        offline(llm, loads["batch 1"])  # warm-up of all
        for url in urls.values():
            served(url, loads["batch 1"])
        for repeat in range(args.repeats):
            order = list(urls) if repeat % 2 == 0 else list(urls)[::-1]  # no server always runs first
            for load, prompts in loads.items():
                rates.setdefault((load, "engine"), []).append(offline(llm, prompts))
                for name in order:
                    url = urls[name]
                    rate, cpu = served(url, prompts)
                    rates.setdefault((load, name), []).append(rate)
                    rates.setdefault((load, name, "client"), []).append(cpu)
                print(f"{load}: engine {rates[load, 'engine'][-1]:.1f}, "
                      + ", ".join(f"{name} {rates[load, name][-1]:.1f}" for name in urls) + " tok/s", flush=True)
    rows = []
    for load in loads:
        e = statistics.median(rates[load, "engine"])
        row = [load, e]
        for name in SERVERS:
            s = statistics.median(rates[load, name])
            row += [s, s / e]
        first = statistics.median(rates[load, next(iter(SERVERS))]) / e
        row += ["pass" if first >= TARGET else "FAIL", statistics.median(rates[load, next(iter(SERVERS)), "client"])]
        rows.append(row)
    head = ["load", "offline engine tok/s"]
    for name in SERVERS:
        head += [f"server, {name}: tok/s", "/ engine"]
    body = markdown_table(head + [f"target {TARGET} (core process)", "client CPU s per run"], rows)
    body += (f"\n\nMedians of {args.repeats} alternating runs (the servers' order swapped each repeat); greedy, "
             f"{MAX_TOKENS} new tokens with ignore_eos, "
             f"prompt processing included; OpenMP runtime: {openmp.describe()}. The core-process server is the "
             "default `specserve serve`; the engine-thread one runs with `--disable-frontend-multiprocessing`. "
             "The client (bench.sse_client: asyncio, one thread, every event parsed) runs on the same cores.")
    write_report("server_vs_engine", "The HTTP server against the offline engine, same requests", body,
                 f"python -m bench.server_vs_engine --repeats {args.repeats}")


if __name__ == "__main__":
    main()
