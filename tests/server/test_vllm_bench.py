"""vLLM's own benchmark client, ``vllm bench serve``, run unchanged against a live
specserve with ngram speculation: on Spec-Bench and random prompts, through the chat
and the completions endpoints, every request succeeds and the acceptance it prints
(rate, length, per position: the deltas of ``vllm:spec_decode_*`` it reads from
/metrics before and after) equals the deltas of the server's own counters.

Marked ``slow`` (a run takes minutes: importing vLLM alone takes one). It needs vLLM's
CPU build in ``$PEERS/venv-vllm`` (default ``~/peers``; ``bench/peers.py`` says how
it is installed) and skips without it.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench.peers import VLLM_MAIN
from engine.worker.model_store import fetch_default_model
from tests.server.bench_clients import ngram_server, spec_counters
from tests.server.conftest import MODEL, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PEERS = Path(os.environ.get("PEERS", Path.home() / "peers"))
VLLM_PYTHON = PEERS / "venv-vllm" / "bin" / "python"
SPEC_BENCH = Path(__file__).resolve().parents[2] / "bench" / "data" / "spec_bench" / "question.jsonl"
K = 4
NUM_PROMPTS = 4
DATASETS = {
    # Spec-Bench's extraction questions quote a text the answer copies from: ngram's ground
    "spec_bench": ["--dataset-name", "spec_bench", "--dataset-path", str(SPEC_BENCH),
                   "--spec-bench-category", "extraction", "--spec-bench-output-len", "48"],
    "random": ["--dataset-name", "random", "--random-input-len", "96", "--random-output-len", "48", "--ignore-eos"],
}
ENDPOINTS = {"chat": ("openai-chat", "/v1/chat/completions"), "completions": ("openai", "/v1/completions")}


@pytest.fixture(scope="module")
def server(default_engine):
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM's CPU build is not installed in {VLLM_PYTHON.parent.parent}")
    with ngram_server(default_engine, K) as s:
        yield s


def vllm_bench(server, dataset: str, endpoint: str, out: Path) -> tuple[dict, str]:
    backend, path = ENDPOINTS[endpoint]
    cmd = [str(VLLM_PYTHON), "-c", VLLM_MAIN, "bench", "serve", "--backend", backend, "--endpoint", path,
           "--base-url", server.url, "--model", MODEL, "--tokenizer", str(fetch_default_model()),
           *DATASETS[dataset], "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", str(NUM_PROMPTS),
           "--temperature", "0", "--seed", "0", "--disable-tqdm",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0 and out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r.stdout


def report(stdout: str) -> str:
    """vLLM's printed result table (from its banner to the end of the speculative section)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if "Serving Benchmark Result" in line)
    end = max(i for i, line in enumerate(lines) if line.startswith("=" * 20))
    return "\n".join(lines[start : end + 1])


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
@pytest.mark.parametrize("dataset", list(DATASETS))
def test_vllm_bench_serve_reports_our_counters(server, dataset, endpoint, tmp_path):
    before = spec_counters(server, K)
    result, stdout = vllm_bench(server, dataset, endpoint, tmp_path / "result.json")
    wait_idle(server.engine)
    after = spec_counters(server, K)
    print(f"\n--- vllm bench serve, {dataset}, {endpoint} ---\n{report(stdout)}")
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result["errors"]

    drafts = after["drafts"] - before["drafts"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"])]
    print(f"our counters' deltas: drafts {drafts:g}, draft tokens {drafted:g}, accepted {accepted:g}, "
          f"per position {per_pos}")
    assert drafts > 0 and accepted > 0, "the workload should draft and accept"
    assert result["spec_decode_num_drafts"] == drafts
    assert result["spec_decode_draft_tokens"] == drafted
    assert result["spec_decode_accepted_tokens"] == accepted
    assert result["spec_decode_acceptance_rate"] == pytest.approx(100 * accepted / drafted, rel=1e-12)
    assert result["spec_decode_acceptance_length"] == pytest.approx(1 + accepted / drafts, rel=1e-12)
    assert result["spec_decode_per_position_acceptance_rates"] == pytest.approx([n / drafts for n in per_pos], rel=1e-12)
