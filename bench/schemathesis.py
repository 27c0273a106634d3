"""Schemathesis fuzzes specserve against vLLM's OpenAPI document (completions, chat, models).

    .venv/bin/python -m bench schemathesis [--max-examples 40] [--seed 53] [--model PATH]
        [--max-model-len 64] [--timeout 1200] [--phases examples,fuzzing,stateful]

Serves ``--model`` (default: the default model) with prompt lookup on (so the speculative
path is fuzzed too) and a short context, so that a fuzzed ``max_tokens`` beyond the
context left is refused at once. Then runs ``st run`` on ``bench/data/vllm_openapi.json``
(vLLM's document, cut to the three operations: bench/data/README.md), one worker, a fixed
seed, a capped number of examples per operation, the phases asked for (examples,
fuzzing and stateful by default; coverage too with ``--phases``), a timeout per request
and one for the whole run. The checks: no 5xx,
status codes, content types, headers and bodies conforming to vLLM's document (its error
``code`` widened to OpenAI's string: ``bench/schemathesis_hooks.py``), every 4xx an OpenAI
error object, 405 with ``Allow`` for other methods. Not checked: whether a schema-valid
body is accepted (vLLM's document is looser than vLLM itself: an empty ``messages`` is
valid there) or a schema-invalid one refused. Writes bench/results/schemathesis.md
(schemathesis' summary, the statuses answered) and exits 1 when a check failed.
"""

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import DATA, ROOT, markdown_table, write_report
from bench.server_procs import serve

DOCUMENT = DATA / "vllm_openapi.json"
CHECKS = [
    "not_a_server_error", "status_code_conformance", "content_type_conformance", "response_headers_conformance",
    "response_schema_conformance", "unsupported_method", "allow_header_conformance", "missing_required_header",
    "openai_error",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


@dataclass
class Fuzz:
    returncode: int  # st's: 0 when every check passed
    seconds: float
    statuses: dict = field(default_factory=dict)  # {operation: {status: count}}
    refusals: collections.Counter = field(default_factory=collections.Counter)  # {(operation, status, message): count}
    output: str = ""  # st's whole output

    @property
    def summary(self) -> str:
        """st's closing summary (from its SUMMARY rule on), or its whole output when it has none."""
        lines = self.output.splitlines()
        start = next((i for i, line in enumerate(lines) if " SUMMARY " in line), 0)
        return "\n".join(lines[start:]).strip()

    @property
    def server_errors(self) -> int:
        return sum(n for counts in self.statuses.values() for s, n in counts.items() if s >= 500)


def server_args(model: str | None, max_model_len: int) -> list[str]:
    return [*(["--model", model] if model else []), "--max-model-len", str(max_model_len), "--max-n", "4",
            "--speculative-config", json.dumps(NGRAM), "--log-level", "warning"]


def st_command(url: str, seed: int, max_examples: int, request_timeout: float, phases: str) -> list[str]:
    st = Path(sys.executable).with_name("st")
    return [str(st), "run", str(DOCUMENT), "--url", url, "--checks", ",".join(CHECKS),
            "--phases", phases, "--seed", str(seed), "--max-examples", str(max_examples),
            "--request-timeout", str(request_timeout), "--workers", "1", "--generation-database", "none",
            "--suppress-health-check", "all", "--no-color"]


def tally(path: Path) -> tuple[dict, collections.Counter]:
    """{operation: {status: count}} and the 4xx messages' counts, from the hooks' log."""
    counts: dict = collections.defaultdict(collections.Counter)
    messages: collections.Counter = collections.Counter()
    for line in path.read_text().splitlines():
        op, status, message = line.split("\t")
        counts[op][int(status)] += 1
        messages[(op, int(status), message)] += 400 <= int(status) < 500
    return {op: dict(sorted(c.items())) for op, c in sorted(counts.items())}, +messages


def fuzz(model: str | None = None, max_model_len: int = 64, seed: int = 53, max_examples: int = 40,
         request_timeout: float = 60, timeout: float = 1200, log_dir: str | None = None,
         phases: str = "examples,coverage,fuzzing,stateful") -> Fuzz:
    """Serves ``model`` and runs schemathesis against it; at most ``timeout`` seconds for st."""
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(log_dir or tmp)
        status_log = logs / "statuses.tsv"
        status_log.write_text("")
        with serve(server_args(model, max_model_len), str(logs / "server.log")) as url:
            env = {**os.environ, "SCHEMATHESIS_HOOKS": "bench.schemathesis_hooks", "SPECSERVE_FUZZ_STATUS_LOG": str(status_log),
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            t0 = time.monotonic()
            try:
                done = subprocess.run(st_command(url, seed, max_examples, request_timeout, phases), cwd=tmp, env=env,
                                      capture_output=True, text=True, timeout=timeout)
                rc, out = done.returncode, done.stdout + done.stderr
            except subprocess.TimeoutExpired as e:
                partial = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
                rc, out = 124, f"{partial}\nst did not finish within {timeout:.0f} s"
            seconds = time.monotonic() - t0
        return Fuzz(rc, seconds, *tally(status_log), out)


def report(result: Fuzz, args) -> str:
    rows = [[op, ", ".join(f"{s}: {n}" for s, n in counts.items()), sum(counts.values())]
            for op, counts in result.statuses.items()]
    model = args.model or "the default model (SmolLM2-135M-Instruct, Q4_1 GGUF)"
    return "\n\n".join([
        f"Server: {model}, `{' '.join(server_args(None, args.max_model_len)[:-2])}`.",
        f"Phases: {args.phases}; at most {args.max_examples} examples per operation; seed {args.seed}.",
        f"st ran {result.seconds:.0f} s (bound {args.timeout:.0f} s), exit code {result.returncode}; "
        f"{result.server_errors} responses with a 5xx.",
        markdown_table(["operation", "statuses", "requests"], rows),
        "The most frequent 4xx answers:",
        markdown_table(["operation", "status", "message", "count"],
                       [[*key, n] for key, n in result.refusals.most_common(12)]),
        "Schemathesis' summary:",
        "```\n" + result.summary + "\n```",
    ])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a local checkpoint or .gguf (default: the default model)")
    p.add_argument("--max-model-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=53)
    p.add_argument("--max-examples", type=int, default=40, help="test cases per operation and phase")
    p.add_argument("--request-timeout", type=float, default=60)
    p.add_argument("--timeout", type=float, default=1200, help="seconds st may run in all")
    p.add_argument("--phases", default="examples,fuzzing,stateful",
                   help="st's phases; coverage (boundary values of every field) adds many minutes on 2 cores")
    args = p.parse_args()
    result = fuzz(args.model, args.max_model_len, args.seed, args.max_examples, args.request_timeout, args.timeout,
                  phases=args.phases)
    print(result.output)
    path = write_report("schemathesis", "Schemathesis against vLLM's OpenAPI document", report(result, args),
                        "python -m bench schemathesis")
    print(f"wrote {path}")
    return 0 if result.returncode == 0 and not result.server_errors else 1


if __name__ == "__main__":
    sys.exit(main())
