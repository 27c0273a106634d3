"""Suffix decoding beside vLLM's: the agent-like sessions at batch 1 through each HTTP server.

    .venv/bin/python -m bench.suffix_peers [--servers specserve,specserve-suffix,vllm,vllm-suffix]
        [--peers-dir ~/peers] [--scale 1] [--max-tokens 96] [--workloads agent-code,...]

The workloads of ``bench.suffix`` (bench/agent_workload.py: agent loops, repeated-task
extraction, retries, Spec-Bench questions), each session's turns sent with the conversation so
far, greedy, ending at EOS or ``--max-tokens``. The servers are ``bench.peers``' names, all up
at once: ``-suffix`` adds ``{"method": "suffix"}`` (vLLM's keys and defaults, the same on
both; ``vllm-suffix`` needs ``arctic-inference`` installed beside vLLM). A session goes to
each server in turn, the order rotated session by session, each server left idle first
(``settle``). Per workload and server: tokens, tok/s (wall, prompts included), the speedup
over the same server without ``-suffix``, and whether every greedy text equals that server's.
Writes bench/results/suffix_peers.md.
"""

import argparse
import os
import time
from collections import defaultdict
from pathlib import Path

import httpx

from bench import peers
from bench.agent_workload import workloads
from bench.common import markdown_table, rotated, write_report
from bench.server_procs import settle

SERVERS = "specserve,specserve-suffix,vllm,vllm-suffix"


def served(names: list[str], sets: dict, max_tokens: int, peers_dir: Path) -> list[list]:
    """Every workload through every installed server: the table's rows."""
    with peers.servers(names, peers_dir, log_prefix="specserve-suffix-peers") as (urls, procs):
        for url in urls.values():  # warm-up, not counted
            session(url, ["Say hello."], 8)
        pids = [p.pid for p in procs]
        return [row for w, (wname, sessions) in enumerate(sets.items())
                for row in workload(urls, wname, sessions, w, max_tokens, pids)]


def workload(urls: dict, wname: str, sessions: list[list[str]], w: int, max_tokens: int, pids: list[int]) -> list[list]:
    runs = {n: {"tokens": 0, "seconds": 0.0, "texts": []} for n in urls}
    for i, turns in enumerate(sessions):
        for n in rotated(list(urls), i + w):
            settle(pids)
            tokens, seconds, texts = session(urls[n], turns, max_tokens)
            runs[n]["tokens"] += tokens
            runs[n]["seconds"] += seconds
            runs[n]["texts"] += texts
    rows = []
    for n, r in runs.items():
        plain = runs.get(n.replace("-suffix", ""), r)
        speed = r["tokens"] / r["seconds"] / (plain["tokens"] / plain["seconds"])
        rows.append([wname, n, r["tokens"], r["tokens"] / r["seconds"], speed,
                     "yes" if r["texts"] == plain["texts"] else "NO"])
        print(rows[-1], flush=True)
    return rows


def session(url: str, turns: list[str], max_tokens: int) -> tuple[int, float, list[str]]:
    """One session's turns, each sent with the conversation so far: completion tokens, wall
    seconds, the answers."""
    history, tokens, texts = [], 0, []
    t = time.perf_counter()
    for turn in turns:
        history.append({"role": "user", "content": turn})
        body = {"model": "smol", "messages": history, "max_tokens": max_tokens, "temperature": 0}
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900)
        r.raise_for_status()
        out = r.json()
        tokens += out["usage"]["completion_tokens"]
        texts.append(out["choices"][0]["message"]["content"])
        history.append({"role": "assistant", "content": texts[-1]})
    return tokens, time.perf_counter() - t, texts


def together(rows: list[list]) -> str:
    """Over the agent-like workloads (not Spec-Bench), tokens over seconds per server."""
    tot = defaultdict(lambda: [0, 0.0])
    for w, n, tokens, rate, *_ in rows:
        if w != "spec-bench":
            tot[n][0] += tokens
            tot[n][1] += tokens / rate
    lines = []
    for n, (t, sec) in tot.items():
        plain = tot.get(n.replace("-suffix", ""))
        lines.append(f"- {n}: {t / sec:.1f} tok/s" + (f", {t / sec / (plain[0] / plain[1]):.2f}x its plain"
                                                      if n.endswith("-suffix") and plain else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=SERVERS)
    ap.add_argument("--peers-dir", type=Path, default=Path(os.environ.get("PEERS", Path.home() / "peers")))
    ap.add_argument("--scale", type=int, default=1, help="multiplies the sessions of each workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--workloads", default=None, help="comma-separated subset")
    args = ap.parse_args()
    sets = workloads(args.scale)
    if args.workloads:
        sets = {k: v for k, v in sets.items() if k in args.workloads.split(",")}
    rows = served(args.servers.split(","), sets, args.max_tokens, args.peers_dir)
    body = markdown_table(["workload", "server", "tokens", "tok/s", "speedup over its plain", "greedy = its plain"],
                          rows)
    body += ("\n\nAgent-like workloads together (tokens over seconds):\n\n" + together(rows) +
             "\n\nspecserve serves the default Q4_1 model, vLLM (and any -float32 server) its float32 conversion. "
             "One run: the machine's speed drifts between sessions, so a single row can be off by a third.")
    cmd = f"python -m bench.suffix_peers --servers {args.servers} --scale {args.scale} --max-tokens {args.max_tokens}"
    if args.workloads:
        cmd += f" --workloads {args.workloads}"
    write_report("suffix_peers", "Suffix decoding beside vLLM's, through each HTTP server (batch 1, greedy)", body, cmd)


if __name__ == "__main__":
    main()
