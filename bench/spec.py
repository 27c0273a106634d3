"""Speculative decoding per Spec-Bench category: plain vs ngram vs early_exit vs eagle3,
ngram and early_exit also as token trees.

    .venv/bin/python -m bench.spec [--prompts 5] [--mt-prompts 2] [--max-tokens 256]
        [--methods plain,ngram,...] [--categories qa,stem,...] [--eagle-head DIR]
        [--baseline CHECKOUT]   # each chosen method but plain also as METHOD@base: an older commit
    .venv/bin/python -m bench.spec --categories qa --prompts 1 --max-tokens 16 \
        --methods plain,ngram,ngram-tree    # a smoke run

The eagle3 and ngram+eagle3 rows use the head that ``specserve train-eagle`` wrote
(default: ~/.cache/specserve/heads/SmolLM2-135M-Instruct-eagle3); without one they are left out.

One ``specserve serve`` process per method on loopback (all fp32 on
the CPU, batch 1) answer the same prompts in turn, prompt by prompt, so that the
ratios are measured side by side. Acceptance figures come from each server's
/metrics (the counters the Grafana dashboard reads), as deltas per category.

Columns: end-to-end tokens/s (prompt processing included) and its speedup over
plain, over the category's prompts together and prompt by prompt (min-max);
mean acceptance length (1 + accepted / drafting rounds); tokens per target
pass in the decode phase (1 + accepted / decode steps); acceptance by draft
position (share of rounds whose first i drafts were all accepted); the
measured decode-phase speedup against the ideal one from the reference's
formula, ``S = n / (g c + V)`` per decode step, with the measured acceptance
(n tokens per step), the measured drafting cost ``g c`` and verification
cost ``V``, both in units of the plain server's mean decode step.
Writes bench/results/spec.md and spec.png.
"""

import argparse
import json
from collections import defaultdict

from bench.common import RESULTS, code_edit_prompt, markdown_table, spec_bench, write_report
from bench.server_procs import metric, scrape, serve, stream_chat

METHODS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 8},
    "early_exit": {"method": "early_exit", "num_speculative_tokens": 3, "num_layers": 8},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 4},
    "ngram+eagle3": {"method": "ngram+eagle3", "num_speculative_tokens": 8, "prompt_lookup_max": 8},
    # Token trees: the adaptive policy picks each round's shape (or a chain) within these bounds.
    "ngram-tree": {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 8, "tree_width": 3,
                   "max_tree_nodes": 24},
    "eagle3-tree": {"method": "eagle3", "num_speculative_tokens": 4, "tree_width": 4, "max_tree_nodes": 16},
    "early_exit-tree": {"method": "early_exit", "num_speculative_tokens": 3, "num_layers": 8, "tree_width": 2,
                        "max_tree_nodes": 8},
}
EAGLE_HEAD = "~/.cache/specserve/heads/SmolLM2-135M-Instruct-eagle3"
BASE = "@base"  # suffix of a method served from the --baseline checkout
MT_BENCH = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]


def categories(n: int, n_mt: int) -> dict[str, list[str]]:
    cats = {"code-edit": [code_edit_prompt()]}
    for c in ("summarization", "rag", "translation", "qa", "math_reasoning"):
        cats[c] = spec_bench(c, n)
    for c in MT_BENCH:  # the target holds per MT-Bench category: one row each
        cats[f"mt-bench/{c}"] = spec_bench(c, n_mt)
    return cats


SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "steps": "specserve_decode_step_time_seconds_count",
    "step_s": "specserve_decode_step_time_seconds_sum",
    "draft_s": "specserve_spec_decode_draft_time_seconds_sum",
    "verify_s": "specserve_spec_decode_verify_time_seconds_sum",
}


def snapshot(url: str, k: int) -> dict:
    samples = scrape(url)
    snap = {key: metric(samples, name) for key, name in SPEC_COUNTERS.items()}
    snap["per_pos"] = [
        metric(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(k)
    ]
    return snap


def delta(after: dict, before: dict) -> dict:
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    d["per_pos"] = [a - b for a, b in zip(after["per_pos"], before["per_pos"])]
    return d


def select_methods(args) -> None:
    """Keeps the chosen methods (plain always), in order; the eagle ones get the head's path."""
    from pathlib import Path

    head = Path(args.eagle_head).expanduser()
    chosen = set(args.methods.split(",")) | {"plain"}
    for name in list(METHODS):
        spec = METHODS[name]
        if name not in chosen or (spec and "eagle" in spec["method"] and not head.is_dir()):
            if name in chosen:
                print(f"{name}: no head in {head} (run specserve train-eagle); left out")
            del METHODS[name]
        elif spec and "eagle" in spec["method"]:
            spec["model"] = str(head)
    if args.baseline:
        for name in [m for m in METHODS if m != "plain"]:
            METHODS[name + BASE] = METHODS[name]


def run(args) -> dict:
    cats = categories(args.prompts, args.mt_prompts)
    if args.categories:
        wanted = args.categories.split(",")
        cats = {c: p for c, p in cats.items() if c in wanted or c.split("/")[-1] in wanted}
    methods = METHODS
    k_max = max((m or {}).get("num_speculative_tokens", 0) for m in methods.values())
    results: dict = defaultdict(dict)  # [category][method] -> figures
    from contextlib import ExitStack

    with ExitStack() as stack:
        urls = {}
        for name, spec in methods.items():
            extra = ["--max-model-len", "4096", "--kv-cache-memory-bytes", str(512 << 20)]
            if spec:
                extra += ["--speculative-config", json.dumps(spec)]
            cwd = args.baseline if name.endswith(BASE) else None
            urls[name] = stack.enter_context(serve(extra, str(RESULTS / f"spec-server-{name}.log"), cwd=cwd))
        for url in urls.values():  # warm-up: first-call costs stay out of the figures
            stream_chat(url, "Say hello.", 16)
        for cat, prompts in cats.items():
            before = {m: snapshot(u, k_max) for m, u in urls.items()}
            runs = defaultdict(list)
            for prompt in prompts:
                for m, u in urls.items():
                    runs[m].append(stream_chat(u, prompt, args.max_tokens))
            for m, u in urls.items():
                results[cat][m] = {"runs": runs[m], "metrics": delta(snapshot(u, k_max), before[m])}
            print(cat, summarize_category(results[cat])[0], flush=True)
    return results


def summarize_category(by_method: dict) -> tuple[list[list], dict]:
    """Table rows for one category, and per-position acceptance per method."""
    plain = by_method["plain"]
    plain_step = plain["metrics"]["step_s"] / max(plain["metrics"]["steps"], 1)
    e2e = {m: _rate(r["runs"], "total_s", 0) for m, r in by_method.items()}
    dec = {m: _rate(r["runs"], "decode_s", 1) for m, r in by_method.items()}
    rows, per_pos = [], {}
    for m, r in by_method.items():
        x = r["metrics"]
        tokens = sum(run["usage"]["completion_tokens"] for run in r["runs"])
        row = [m, tokens, e2e[m], e2e[m] / e2e["plain"], _spread(r["runs"], plain["runs"])]
        if m == "plain" or not x["drafts"]:
            rows.append(row + ["-", 1.0, "-", dec[m] / dec["plain"], "-", "-"])
            continue
        steps = max(x["steps"], 1)
        n_step = (steps + x["accepted"]) / steps  # tokens per decode step (target pass)
        cost = (x["draft_s"] + x["verify_s"]) / steps / plain_step  # g c + V, in plain decode steps
        ideal = n_step / cost
        per_pos[m] = [p / x["drafts"] for p in x["per_pos"] if True][: _k(x)]
        pos = " ".join(f"{a:.2f}" for a in per_pos[m])
        rows.append(row + [1 + x["accepted"] / x["drafts"], n_step, pos, dec[m] / dec["plain"], ideal,
                           f"{x['draft_s'] / steps / plain_step:.2f} + {x['verify_s'] / steps / plain_step:.2f}"])
    return rows, per_pos


def _spread(runs: list[dict], plain_runs: list[dict]) -> str:
    """Min-max over prompts of the end-to-end speedup against plain on the same prompt."""
    speed = [_rate([r], "total_s", 0) / _rate([p], "total_s", 0) for r, p in zip(runs, plain_runs)]
    return f"{min(speed):.2f}-{max(speed):.2f}" if len(speed) > 1 else "-"


def _k(x: dict) -> int:
    return max((i + 1 for i, p in enumerate(x["per_pos"]) if p > 0), default=0)


def _rate(runs: list[dict], key: str, minus: int) -> float:
    tokens = sum(r["usage"]["completion_tokens"] - minus for r in runs)
    return tokens / max(sum(r[key] for r in runs), 1e-9)


def report(results: dict, args) -> None:
    header = ["category", "method", "tokens", "tok/s (e2e)", "speedup", "per prompt", "mean acc. length",
              "tokens/pass", "acceptance by position", "decode speedup", "ideal (formula)", "cost g·c + V"]
    rows, per_pos_all = [], {}
    for cat, by_method in results.items():
        cat_rows, per_pos = summarize_category(by_method)
        rows += [[cat] + r for r in cat_rows]
        per_pos_all[cat] = per_pos
    body = markdown_table(header, rows)
    body += "\n\n" + mt_bench_line(results) + "\n\n" + tree_vs_chain(results)
    body += ("\n\nSpeedups are against plain decoding on the same prompts in the same run; "
             "`ideal` is the reference's S = n / (g c + V) with the measured tokens per decode step n and "
             "the measured per-step drafting and verification costs (in plain decode steps).")
    cmd = f"python -m bench.spec --prompts {args.prompts} --mt-prompts {args.mt_prompts} --max-tokens {args.max_tokens}"
    if args.categories:
        cmd += f" --categories {args.categories}"
    cmd += f" --methods {args.methods}"
    if args.baseline:
        cmd += f" --baseline {args.baseline}"
    write_report("spec", "Speculative decoding by Spec-Bench category (batch 1, greedy)", body, cmd)
    plot(results, per_pos_all)


def mt_bench_line(results: dict) -> str:
    """The slowest MT-Bench category per method (the target: never below plain)."""
    parts = []
    for m in METHODS:
        speed = {}
        for c, by_method in results.items():
            if c.startswith("mt-bench/") and m != "plain" and m in by_method:
                speed[c] = _row(by_method, m)[3]
        if speed:
            c = min(speed, key=speed.get)
            parts.append(f"{m} {speed[c]:.2f}x ({c})")
    return "Slowest MT-Bench category, end to end against plain: " + "; ".join(parts) + "."


def tree_vs_chain(results: dict) -> str:
    """Per category and drafter: the tree's mean acceptance length and end-to-end
    speedup against the chain's, from the same run."""
    header = ["category", "drafter", "acc. length chain", "acc. length tree", "tokens/pass chain",
              "tokens/pass tree", "speedup chain", "speedup tree", "tree / chain"]
    rows = []
    for c, by_method in results.items():
        for m in METHODS:
            suffix = BASE if m.endswith(BASE) else ""
            core = m[: len(m) - len(suffix)]
            chain_name = core[: -len("-tree")] + suffix
            if core.endswith("-tree") and m in by_method and chain_name in by_method:
                chain, tree = _row(by_method, chain_name), _row(by_method, m)
                rows.append([c, chain_name, chain[5], tree[5], chain[6], tree[6], chain[3], tree[3], tree[3] / chain[3]])
    return "Token trees against chains:\n\n" + markdown_table(header, rows) if rows else ""


def _row(by_method: dict, m: str) -> list:
    return next(row for row in summarize_category(by_method)[0] if row[0] == m)


def plot(results: dict, per_pos_all: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = list(results)
    methods = [m for m in METHODS if m != "plain" and m in results[next(iter(results))]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.5))
    b.set_prop_cycle(color=plt.cm.tab20.colors)  # one color per category
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        speed = [_row(results[c], m)[3] for c in cats]
        a.bar([i + j * width for i in range(len(cats))], speed, width, label=m)
    a.axhline(1.0, color="k", lw=0.8)
    a.set_xticks([i + width / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    a.set_ylabel("speedup over plain (end to end)")
    a.legend()
    for c in cats:
        if "ngram" in per_pos_all[c]:
            p = per_pos_all[c]["ngram"]
            b.plot(range(1, len(p) + 1), p, "o-", label=c)
    b.set_xlabel("draft position")
    b.set_ylabel("share of rounds accepting up to it")
    b.set_title("ngram acceptance by position")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(RESULTS / "spec.png", dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=5, help="prompts per Spec-Bench category")
    ap.add_argument("--mt-prompts", type=int, default=2, help="prompts per MT-Bench category")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of the methods")
    ap.add_argument("--categories", default=None, help="comma-separated subset of the categories")
    ap.add_argument("--eagle-head", default=EAGLE_HEAD)
    ap.add_argument("--baseline", default=None,
                    help="a checkout of an older specserve commit: each chosen method but plain also runs from it, "
                    f"as METHOD{BASE}")
    args = ap.parse_args()
    select_methods(args)
    results = run(args)
    (RESULTS / "spec.json").write_text(json.dumps(results, default=str))
    report(results, args)


if __name__ == "__main__":
    main()
