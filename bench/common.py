"""Shared pieces of the benchmarks: prompt sets, chat rendering, reports."""

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "bench" / "data"  # vendored prompt sets, with their licences (data/README.md)
RESULTS = ROOT / "bench" / "results"
CHAT_CATEGORIES = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def spec_bench(category: str, n: int) -> list[str]:
    """First turns of the first ``n`` Spec-Bench questions of a category."""
    path = DATA / "spec_bench" / "question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["turns"][0] for r in rows if r["category"] == category][:n]


def chat_prompts(n: int) -> list[str]:
    """``n`` MT-Bench style chat prompts, spread over the chat categories."""
    per = max(1, -(-n // len(CHAT_CATEGORIES)))
    prompts = [p for c in CHAT_CATEGORIES for p in spec_bench(c, per)]
    return prompts[:: max(1, len(prompts) // n)][:n]


def round_robin_chat(n: int) -> list[str]:
    """``n`` chat prompts taking the categories in turn (one of each, then the next of each...)."""
    per = -(-n // len(CHAT_CATEGORIES))
    by_cat = [spec_bench(c, per) for c in CHAT_CATEGORIES]
    return [p for i in range(per) for ps in by_cat for p in ps[i : i + 1]][:n]


CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a window."""
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result


def normalize(values):
    """Scale values to the range 0..1."""
    low = min(values)
    high = max(values)
    if high == low:
        return [0.0 for _ in values]
    return [(value - low) / (high - low) for value in values]


def summarize(values, window):
    averages = moving_average(values, window)
    scaled = normalize(averages)
    return {"count": len(values), "window": window, "scaled": scaled}
'''


def code_edit_prompt() -> str:
    """Rewrite a given ~30-line piece of code with one identifier renamed (copy-heavy)."""
    return (
        "Rewrite this Python code, renaming the variable `values` to `samples` everywhere. "
        "Output only the code.\n\n```python\n" + CODE + "```"
    )


def render_chat(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(rendered, add_special_tokens=False)


def run_at_once(fn, items: list) -> tuple[list, float]:
    """``fn(item)`` for every item, each on its own thread, all started together;
    returns the results in order and the wall seconds until the last one ended."""
    import threading

    results: list = [None] * len(items)

    def one(i: int) -> None:
        results[i] = fn(items[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(items))]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results, time.perf_counter() - t


def _cpuinfo(field: str) -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(field)), "")


def machine() -> str:
    """The CPU model, its widest vector ISA, the C kernel build the engine runs, cores and threads."""
    flags = set(_cpuinfo("flags").split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    if os.environ.get("SPECSERVE_CPU_KERNELS", "1") == "0" or "avx2" not in flags:
        build = "C kernels off"
    elif isa == "AVX-512" and os.environ.get("SPECSERVE_CPU_AVX512", "1") != "0":
        build = "AVX-512 kernels"
    else:
        build = "AVX2 kernels"
    cpu = _cpuinfo("model name") or platform.processor() or platform.machine()
    return (f"{cpu} ({isa}; {build}), {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def commit() -> str:
    """The checkout's commit, marked when the working tree has uncommitted changes to anything
    but benchmark results (bench/results, docs/benchmarks.md: other runs' outputs, not code)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results", ":!docs/benchmarks.md")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return f"{sha} with uncommitted changes" if dirty else sha or "unknown"


def invocation(name: str, fallback: str) -> str:
    """The command this process runs, as ``python -m bench NAME ARGS``, when it runs the
    benchmark ``name`` as a script; else ``fallback`` (a benchmark called from Python)."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is None or script.resolve() != (ROOT / "bench" / f"{name}.py").resolve():
        return fallback
    return " ".join(["python -m bench", name, *map(shlex.quote, sys.argv[1:])])


def markdown_table(header: list[str], rows: list[list]) -> str:
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_report(name: str, title: str, body: str, command: str) -> Path:
    """Overwrites ``bench/results/<name>.md``, stamped with the machine, the commit, the exact
    command and the time, and rewrites docs/benchmarks.md from the results."""
    from bench.catalog import write_page

    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.md"
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    path.write_text(
        f"# {title}\n\n- Machine: {machine()}\n- Commit: {commit()}\n"
        f"- Command: `{invocation(name, command)}`\n- Run: {stamp}\n\n{body}\n"
    )
    write_page()
    return path


def rotated(items: list, r: int) -> list:
    """``items`` rotated by ``r`` places: over ``len(items)`` rounds each item runs once in
    each place (a server runs a few percent slower right after another's wave; a
    reversal every other round balances two servers, but keeps a middle one of three
    always second)."""
    r %= max(1, len(items))
    return items[r:] + items[:r]


def tiny_model(device, dtype, seed=0):
    """A 2-layer Llama with random weights whose logits are far from ties (as tests/conftest)."""
    from transformers import LlamaConfig

    from engine.models.decoder import LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, 1.0 if ("embed" in name or "lm_head" in name) else p.shape[1] ** -0.5, generator=gen)
    return model.to(device=device, dtype=dtype).eval()


def repetitive_prompts(n: int, vocab: int) -> list[list[int]]:
    """``n`` prompts repeating a random 4-token pattern (prompt lookup drafts them well), 9, 14, ... tokens long."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, vocab, (4,), generator=g).tolist() * 12)[: 9 + 5 * i] for i in range(n)]
