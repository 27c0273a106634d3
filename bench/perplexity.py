"""Perplexity of the default model on one 2,000-token text: served from the GGUF file's Q4_1
blocks (8-bit activations, our kernels), the same with a bfloat16 KV cache
(``--kv-cache-dtype bfloat16``), dequantized to float32 (``--quantization none``), and by
llama.cpp on the same file (llama-cpp-python in ``~/peers/venv-llama``, when there).

    .venv/bin/python -m bench.perplexity [--tokens 2000] [--peers-dir ~/peers]

The text is Spec-Bench's summarization articles (bench/data), one after another until long
enough; every model gets the same token ids in one context and scores each token after
the first from the logits before it (our engine: ``prompt_logprobs``; llama.cpp: its
``logits_all`` scores). Writes bench/results/perplexity.md.
"""

import argparse
import json
import math
import os
import signal
import subprocess
import tempfile
from pathlib import Path

from bench.common import markdown_table, spec_bench, write_report

LLAMA_SCRIPT = """
import json, sys, numpy as np
from llama_cpp import Llama
ids = json.load(open(sys.argv[2]))
llm = Llama(sys.argv[1], n_ctx=len(ids) + 8, n_batch=512, logits_all=True, verbose=False)
llm.eval(ids)
scores = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
m = scores.max(-1, keepdims=True)
logp = scores - m - np.log(np.exp(scores - m).sum(-1, keepdims=True))
json.dump([float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)], open(sys.argv[3], "w"))
"""


def text_ids(tokenizer, tokens: int) -> list[int]:
    articles = spec_bench("summarization", 40)
    ids: list[int] = []
    for a in articles:
        ids += tokenizer.encode(a + "\n\n", add_special_tokens=False)
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ValueError(f"the articles hold only {len(ids)} tokens")


def ours(quantization: str, ids: list[int], kv_cache_dtype: str = "auto") -> list[float]:
    """Log-probabilities of ids[1:] by the default model served with ``quantization`` and ``kv_cache_dtype``."""
    from engine import LLM, SamplingParams

    llm = LLM(quantization=quantization, max_model_len=len(ids) + 8, kv_cache_dtype=kv_cache_dtype)
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    llm.close()
    return [p.logprob for p in out.prompt_logprobs]


def llama_cpp(peers: Path, gguf: Path, ids: list[int]) -> list[float] | str:
    """llama.cpp's log-probabilities of ids[1:], or why there are none (not installed, or how it died)."""
    python = peers / "venv-llama" / "bin" / "python"
    if not python.exists():
        return f"not installed ({python} is missing)"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "ids.json").write_text(json.dumps(ids))
        run = subprocess.run([str(python), "-c", LLAMA_SCRIPT, str(gguf), f"{tmp}/ids.json", f"{tmp}/out.json"],
                             env={**os.environ, "PYTHONPATH": ""}, capture_output=True, text=True)
        if run.returncode:
            how = f"signal {signal.Signals(-run.returncode).name}" if run.returncode < 0 else f"exit {run.returncode}"
            last = run.stderr.strip().splitlines()[-1:]
            return f"llama-cpp-python died with {how}" + "".join(f": {line}" for line in last)
        return json.loads((Path(tmp) / "out.json").read_text())


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def measure(tokens: int, peers: Path) -> tuple[dict[str, float], str | None]:
    """Perplexity by model: "Q4_1 (ours)", with a bfloat16 KV cache, "float32 (ours)" and, where it
    runs, "Q4_1 (llama.cpp)"; and why llama.cpp is missing (None when it ran)."""
    from engine.worker.loader import load_tokenizer
    from engine.worker.model_store import fetch_default_gguf

    gguf = fetch_default_gguf()
    ids = text_ids(load_tokenizer(gguf), tokens)
    out = {"Q4_1 (ours)": perplexity(ours("auto", ids)),
           "Q4_1, bfloat16 KV cache (ours)": perplexity(ours("auto", ids, "bfloat16")),
           "float32 (ours)": perplexity(ours("none", ids))}
    theirs = llama_cpp(peers, gguf, ids)
    if isinstance(theirs, str):
        return out, theirs
    out["Q4_1 (llama.cpp)"] = perplexity(theirs)
    return out, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--peers-dir", type=Path, default=Path(os.environ.get("PEERS", Path.home() / "peers")))
    args = ap.parse_args()
    ppl, missing = measure(args.tokens, args.peers_dir)
    base = ppl["Q4_1 (ours)"]
    body = markdown_table(["model", "perplexity", "vs Q4_1 (ours)"], [[n, p, p / base] for n, p in ppl.items()])
    body += (f"\n\n{args.tokens} tokens of Spec-Bench summarization articles, one context; every token after the "
             "first scored from the logits before it.")
    if missing:
        body += f" No llama.cpp figure on this machine: {missing}."
    write_report("perplexity", "Perplexity of the default model: its Q4_1 blocks, float32, llama.cpp", body,
                 f"python -m bench.perplexity --tokens {args.tokens}")
    print(body)


if __name__ == "__main__":
    main()
