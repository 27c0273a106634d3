"""``specserve serve --model DIR`` on each family's tiny checkpoint answers a chat request
through the HTTP API, rendering the checkpoint's own chat template. A server process per
family: one in the default suite (Gemma 2: windows, soft caps, its template), the rest slow."""

import socket
import subprocess
import sys
import time

import httpx
import pytest

from engine.worker.loader import load_tokenizer
from tests.models.families import FAMILIES

FAST = {"gemma2"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three colors."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(path, port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server.openmp", sys.executable, "-m", "server.cli", "serve", "--model", str(path),
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "256",
           "--kv-cache-memory-bytes", str(16 << 20)]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(proc, url: str, log_path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.3)


@pytest.mark.parametrize("name", [f.name if f.name in FAST else pytest.param(f.name, marks=pytest.mark.slow)
                                  for f in FAMILIES])
def test_serve_answers_a_chat_request(name, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(name)
    port, log_path = free_port(), tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = serve(path, port, log)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(proc, url, log_path)
            body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        finally:
            proc.terminate()
            proc.wait(30)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("length", "stop") and out["usage"]["completion_tokens"] >= 1
    tokenizer = load_tokenizer(path)
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert out["usage"]["prompt_tokens"] == len(tokenizer.encode(rendered, add_special_tokens=False))
