"""Running ``specserve serve`` subprocesses on loopback ports for benchmarks."""

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def settle(pids: list[int], idle_cores: float = 0.1, interval: float = 0.25, timeout: float = 5.0) -> None:
    """Waits until the processes ``pids`` and their children together use less than
    ``idle_cores`` of a core over ``interval`` seconds (at most ``timeout``). A server whose
    threads keep running after its response (vLLM's CPU build: about one core for a
    second) would otherwise slow whichever server is measured next: call it between
    measurements of different servers."""

    def cpu_seconds() -> float:
        total = 0.0
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                for q in [proc, *proc.children(recursive=True)]:
                    times = q.cpu_times()
                    total += times.user + times.system
            except psutil.Error:  # exited in between
                pass
        return total

    t0 = time.monotonic()
    last = cpu_seconds()
    while time.monotonic() - t0 < timeout:
        time.sleep(interval)
        now = cpu_seconds()
        if now - last < idle_cores * interval:
            return
        last = now


@contextmanager
def serve(extra_args: list[str], log_path: str, timeout: float = 300, cwd=None):
    """A ``specserve serve`` on 127.0.0.1; yields its base URL; terminates it on exit.
    ``cwd``: a checkout to serve from (``python -m`` imports from there); default this one."""
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *extra_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                cwd=cwd)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"server did not start; see {log_path}")
                time.sleep(0.5)
            yield url
        finally:
            stop(proc, 60)


def scrape(url: str) -> dict[tuple, float]:
    """Every sample of /metrics as ``{(name, frozenset(labels)): value}``."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def stream_chat(url: str, prompt: str, max_tokens: int, **extra) -> dict:
    """One streamed chat completion; client-side timings and the usage block."""
    body = {
        "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, **extra,
    }
    t0 = time.perf_counter()
    first = None
    usage, text = None, []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    end = time.perf_counter()
    return {"total_s": end - t0, "ttft_s": (first or end) - t0, "decode_s": end - (first or end), "usage": usage,
            "text": "".join(text)}
