"""NVIDIA AIPerf, run unchanged against a live specserve with ngram speculation:
``aiperf profile`` on SPEED-Bench-shaped prompts (written here from Spec-Bench's
summarization questions: nothing is downloaded) scrapes ``/metrics`` before and after
its run, and ``aiperf speed-bench-report`` turns the deltas of ``vllm:spec_decode_*``
into acceptance length and rate. Every request succeeds, AIPerf's counter deltas
equal the server's own, and its report prints the acceptance they imply.

Marked ``slow`` (a run takes minutes on two cores). It needs AIPerf in
``$PEERS/venv-aiperf`` (default ``~/peers``; ``python3 -m venv ~/peers/venv-aiperf &&
~/peers/venv-aiperf/bin/pip install aiperf==0.13.0``) and skips without it.
"""

import csv
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from engine.worker.model_store import fetch_default_model
from tests.server.bench_clients import ngram_server, spec_counters
from tests.server.conftest import MODEL, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PEERS = Path(os.environ.get("PEERS", Path.home() / "peers"))
AIPERF = PEERS / "venv-aiperf" / "bin" / "aiperf"
SPEC_BENCH = Path(__file__).resolve().parents[2] / "bench" / "data" / "spec_bench" / "question.jsonl"
K = 4
NUM_PROMPTS = 4
CATEGORY = "summarization"
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted": "vllm:spec_decode_num_accepted_tokens"}


@pytest.fixture(scope="module")
def server(default_engine):
    if not AIPERF.exists():
        pytest.skip(f"AIPerf is not installed in {AIPERF.parent.parent}")
    with ngram_server(default_engine, K) as s:
        yield s


def speed_bench_file(path: Path) -> Path:
    """SPEED-Bench's JSONL row shape (a 32-hex question id, a category, chat messages)."""
    questions = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines()]
    chosen = [q for q in questions if q["category"] == CATEGORY][:NUM_PROMPTS]
    with open(path, "w") as f:
        for q in chosen:
            qid = hashlib.md5(str(q["question_id"]).encode()).hexdigest()
            f.write(json.dumps({"question_id": qid, "category": CATEGORY,
                                "messages": [{"role": "user", "content": q["turns"][0]}]}) + "\n")
    return path


def aiperf_profile(server, run_dir: Path, prompts: Path) -> None:
    cmd = [str(AIPERF), "profile", "--model", MODEL, "--url", server.url, "--endpoint-type", "chat",
           "--tokenizer", str(fetch_default_model()), "--input-file", str(prompts),
           "--custom-dataset-type", f"speed-bench-{CATEGORY}", "--request-count", str(NUM_PROMPTS),
           "--concurrency", "2", "--extra-inputs", "max_tokens:48", "--extra-inputs", "temperature:0",
           "--use-server-token-count", "--output-artifact-dir", str(run_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def speed_bench_report(runs: Path, metric: str) -> tuple[str, str]:
    out = runs.parent / f"{metric}.csv"
    cmd = [str(AIPERF), "speed-bench-report", str(runs), "--metric", metric, "--format", "both", "--output", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    (row,) = list(csv.DictReader(out.open()))
    assert row["Model"] == MODEL
    return row[CATEGORY], r.stdout


def exported_totals(run_dir: Path) -> dict:
    """AIPerf's deltas over its run, from its server-metrics export."""
    metrics = json.loads((run_dir / "server_metrics_export.json").read_text())["metrics"]

    def total(name, **labels):
        (series,) = [s for s in metrics[name]["series"] if labels.items() <= s["labels"].items()]
        return series["stats"]["total"]

    out = {key: total(name) for key, name in COUNTERS.items()}
    out["per_pos"] = [total("vllm:spec_decode_num_accepted_tokens_per_pos", position=str(i)) for i in range(K)]
    return out


def test_aiperf_reports_the_acceptance_of_our_counters(server, tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / CATEGORY
    before = spec_counters(server, K)
    aiperf_profile(server, run_dir, speed_bench_file(tmp_path / "speed_bench.jsonl"))
    wait_idle(server.engine)
    after = spec_counters(server, K)
    delta = {k: after[k] - before[k] for k in COUNTERS}
    delta["per_pos"] = [a - b for a, b in zip(after["per_pos"], before["per_pos"])]

    profile = json.loads((run_dir / "profile_export_aiperf.json").read_text())
    assert profile["request_count"]["avg"] == NUM_PROMPTS and not profile["error_summary"]
    assert delta["drafts"] > 0 and delta["accepted"] > 0, "the workload should draft and accept"
    assert exported_totals(run_dir) == delta

    length, table = speed_bench_report(runs, "accept_length")
    rate, _ = speed_bench_report(runs, "accept_rate")
    print(f"\n--- aiperf speed-bench-report ---\n{table}\nour counters' deltas: {delta}")
    assert length == f"{1 + delta['accepted'] / delta['drafts']:.2f}"
    assert rate == f"{delta['accepted'] / delta['draft_tokens']:.2f}"
