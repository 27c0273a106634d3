"""Suffix decoding on agent-like traffic: plain vs ngram vs suffix, at batch 1 and concurrent, greedy.

    python -m bench suffix [--scale 1] [--concurrency 16] [--max-tokens 128]
        [--methods plain,ngram,suffix,suffix-chain] [--workloads agent-code,...] [--cost-requests 64]

Workloads (bench/agent_workload.py, generated): agent loops editing one file or calling
JSON tools turn after turn (each turn sends the conversation so far), repeated-task
extraction to one schema, retries of identical requests, and a few Spec-Bench questions.
One engine per method in this process, all on the default model's weights, run the same
sessions in turn (at batch 1 session by session, concurrent workload by workload, the
order rotated); a session's next turn starts when its previous answer ends; the
concurrent runs take ``concurrency / 4`` times the sessions. Figures:
output tokens per second (wall, prompts included) and the speedup over plain; mean
acceptance length; whether every greedy text equals plain's. Then the suffix drafter's
own cost at ``--cost-requests`` concurrent requests (its calls timed inside the steps),
and the global tree's memory with 10,000 cached requests. Writes bench/results/suffix.md
and suffix.png (acceptance by tree depth).
"""

import argparse
import time
from collections import defaultdict

from bench.agent_workload import workloads
from bench.common import RESULTS, markdown_table, rotated, write_report

METHODS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 8},
    "suffix": {"method": "suffix"},
    "suffix-chain": {"method": "suffix", "tree_width": 1},  # on request (--methods): chains only
}
DEFAULT_METHODS = "plain,ngram,suffix"


def build_engines(methods: list[str]) -> dict:
    from engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.config import SpeculativeConfig
    from engine.llm_engine import LLMEngine

    engines, first = {}, None
    for name in methods:
        config = EngineConfig(ModelConfig(max_model_len=4096), CacheConfig(memory_bytes=384 << 20),
                              SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512),
                              SpeculativeConfig.from_dict(METHODS[name]))
        if first is None:
            first = engines[name] = LLMEngine(config)
        else:
            engines[name] = LLMEngine(config, model=first.model, tokenizer=first.tokenizer)
    return engines


def run_sessions(engine, sessions: list[list[str]], concurrency: int, max_tokens: int) -> dict:
    """Runs the sessions, at most ``concurrency`` requests at once; returns the outputs
    (per session, per turn), the wall seconds and the finished requests' spec records."""
    from engine import SamplingParams

    tok = engine.tokenizer
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    history: list[list[dict]] = [[] for _ in sessions]
    outputs: list[list[list[int]]] = [[] for _ in sessions]
    pending, live, spec, n = list(range(len(sessions))), {}, [], 0
    t0 = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            s = pending.pop(0)
            history[s].append({"role": "user", "content": sessions[s][len(outputs[s])]})
            text = tok.apply_chat_template(history[s], add_generation_prompt=True, tokenize=False)
            n += 1
            live[f"r{n}"] = (s, engine.add_request(f"r{n}", tok.encode(text, add_special_tokens=False), params))
        for out in engine.step():
            if out.finished and out.request_id in live:
                s, req = live.pop(out.request_id)
                spec.append(out.spec)
                outputs[s].append(list(req.output_token_ids))
                history[s].append({"role": "assistant", "content": tok.decode(req.output_token_ids,
                                                                              skip_special_tokens=True)})
                if len(outputs[s]) < len(sessions[s]):
                    pending.insert(0, s)
    return {"outputs": outputs, "seconds": time.perf_counter() - t0, "spec": spec}


def acceptance(spec: list[dict]) -> tuple[float, list[float]]:
    """Mean acceptance length, and per depth d the share of rounds that accepted d drafts or more."""
    accepted = [a for s in spec for a in s.get("per_step_accepted", [])]
    if not accepted:
        return 1.0, []
    depth = [sum(a >= d for a in accepted) / len(accepted) for d in range(1, max(accepted) + 1)]
    return 1 + sum(accepted) / len(accepted), depth


def compare(engines: dict, sets: dict, concurrency: int, max_tokens: int) -> tuple[list[list], dict]:
    """Per workload and method: tokens, tok/s, speedup over plain, acceptance, greedy = plain.
    At batch 1 the methods take each session in turn (the order rotated session by session),
    at higher concurrency each workload (rotated workload by workload), so that the load of
    a shared machine falls on them alike."""
    rows, depths = [], defaultdict(dict)
    for w, (wname, sessions) in enumerate(sets.items()):
        groups = [[s] for s in sessions] if concurrency == 1 else [sessions]
        runs = {m: {"outputs": [], "seconds": 0.0, "spec": []} for m in engines}
        for g, group in enumerate(groups):
            for m in rotated(list(engines), g + w):
                r = run_sessions(engines[m], group, concurrency, max_tokens)
                for key in ("outputs", "spec"):
                    runs[m][key] += r[key]
                runs[m]["seconds"] += r["seconds"]
        plain = runs.get("plain")
        for m, r in runs.items():
            tokens = sum(len(t) for s in r["outputs"] for t in s)
            rate = tokens / r["seconds"]
            speed = rate / (sum(len(t) for s in plain["outputs"] for t in s) / plain["seconds"]) if plain else 1.0
            mean, depth = acceptance(r["spec"])
            depths[wname][m] = depth
            same = "yes" if plain is None or r["outputs"] == plain["outputs"] else "NO"
            rows.append([wname, concurrency, m, tokens, rate, speed, mean if m != "plain" else "-", same])
            print(rows[-1], flush=True)
    return rows, depths


def drafter_cost(engine, sessions: list[list[str]], max_tokens: int) -> dict:
    """The drafter's seconds per step (its calls timed) against the step's, at len(sessions) at once."""
    d = engine.speculator.drafter
    spent = [0.0]

    def timed(f):
        def g(*a):
            t = time.perf_counter()
            try:
                return f(*a)
            finally:
                spent[0] += time.perf_counter() - t
        return g

    for name in ("context_class", "propose", "commit", "free"):
        setattr(d, name, timed(getattr(d, name)))
    steps = [0]
    step = engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    try:
        r = run_sessions(engine, sessions, len(sessions), max_tokens)
    finally:
        for name in ("context_class", "propose", "commit", "free", "step"):
            delattr(d if name != "step" else engine, name)
    per_step = r["seconds"] / steps[0]
    return {"step_ms": 1e3 * per_step, "draft_ms": 1e3 * spent[0] / steps[0], "share": spent[0] / r["seconds"],
            "per_request_us": 1e6 * spent[0] / steps[0] / len(sessions)}


def global_memory(num_requests: int = 10_000, output_len: int = 256) -> dict:
    """The suffix index's bytes with ``num_requests`` finished requests' outputs cached."""
    import random

    from drafters.suffix import SuffixIndex

    rng = random.Random(0)
    ix = SuffixIndex(24, num_requests)
    t = time.perf_counter()
    for _ in range(num_requests):
        sid = ix.open(out_start=32, shared=True)
        ix.append(sid, [rng.randrange(49152) for _ in range(32)])
        for _ in range(output_len // 8):  # appended a few tokens a step, as the engine does
            ix.append(sid, [int(rng.paretovariate(1.2)) % 49152 for _ in range(8)])
        ix.close(sid)
    seconds = time.perf_counter() - t
    return {"mb": ix.memory_bytes() / 2**20, "append_us": 1e6 * seconds / (num_requests * (output_len + 32)),
            "requests": num_requests, "output_len": output_len}


def plot(depths: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for wname, by_method in depths.items():
        d = by_method.get("suffix")
        if d:
            ax.plot(range(1, len(d) + 1), d, "o-", label=wname, markersize=3)
    ax.set_xlabel("tree depth d (drafts accepted on the path)")
    ax.set_ylabel("share of rounds reaching depth d")
    ax.set_title("suffix decoding: acceptance by tree depth (batch 1)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "suffix.png", dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scale", type=int, default=1, help="multiplies the sessions of each workload")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--workloads", default=None, help="comma-separated subset")
    ap.add_argument("--cost-requests", type=int, default=64, help="concurrent requests of the cost measurement (0: none)")
    args = ap.parse_args()
    methods = [m for m in METHODS if m in args.methods.split(",") or m == "plain"]
    sets = workloads(args.scale)
    if args.workloads:
        sets = {k: v for k, v in sets.items() if k in args.workloads.split(",")}
    engines = build_engines(methods)
    for e in engines.values():  # warm-up: first-call costs stay out of the figures
        run_sessions(e, [["Say hello."]], 1, 8)
    rows, depths = compare(engines, sets, 1, args.max_tokens)
    if args.concurrency > 1:
        big = {k: v for k, v in workloads(max(1, args.concurrency // 4)).items() if k in sets and k != "spec-bench"}
        rows += compare(engines, big, args.concurrency, args.max_tokens)[0]
    body = markdown_table(["workload", "concurrent", "method", "tokens", "tok/s", "speedup", "mean acc. length",
                           "greedy = plain"], rows)
    body += "\n\n" + speedup_lines(rows)
    if args.cost_requests and "suffix" in engines:
        from bench.agent_workload import repeated_task

        c = drafter_cost(engines["suffix"], repeated_task(args.cost_requests), 64)
        body += (f"\n\nSuffix drafting cost at {args.cost_requests} concurrent requests (repeated-task, its calls "
                 f"timed inside the steps): {c['draft_ms']:.2f} ms per step of {c['step_ms']:.1f} ms "
                 f"({100 * c['share']:.1f}%), {c['per_request_us']:.0f} us per request per step.")
    m = global_memory()
    body += (f"\n\nGlobal tree memory with {m['requests']:,} cached requests of {m['output_len']} output tokens: "
             f"{m['mb']:.0f} MiB (fixed tables plus the tokens); {m['append_us']:.2f} us per appended token.")
    cmd = (f"python -m bench.suffix --scale {args.scale} --concurrency {args.concurrency} "
           f"--max-tokens {args.max_tokens} --methods {args.methods}")
    if args.workloads:
        cmd += f" --workloads {args.workloads}"
    plot(depths)  # first: the report's page lists the picture
    write_report("suffix", "Suffix decoding on agent-like traffic (greedy, default model)", body, cmd)


def speedup_lines(rows: list[list]) -> str:
    """Over the agent-like workloads together (tokens over seconds): suffix against plain and ngram."""
    out = []
    for conc in sorted({r[1] for r in rows}):
        tot = defaultdict(lambda: [0, 0.0])
        for w, c, m, tokens, rate, *_ in rows:
            if c == conc and w != "spec-bench":
                tot[m][0] += tokens
                tot[m][1] += tokens / rate
        rate = {m: t / s for m, (t, s) in tot.items() if s}
        if "suffix" in rate and "plain" in rate:
            vs = f"; {rate['suffix'] / rate['ngram']:.2f}x ngram" if "ngram" in rate else ""
            out.append(f"- {conc} concurrent, agent-like workloads together: suffix {rate['suffix'] / rate['plain']:.2f}x "
                       f"plain{vs}.")
    return "\n".join(out)


if __name__ == "__main__":
    main()
