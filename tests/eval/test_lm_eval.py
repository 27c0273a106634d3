"""lm-evaluation-harness against a live server: its ``local-completions`` model
(loglikelihood requests as echo + logprobs, generate_until as plain greedy
completions) gives the same per-request results as its own ``hf`` model on the
same weights (float32, greedy): the same generated text, and loglikelihoods
within 1e-4. The tasks are local (tasks/*.yaml over tasks/qa.jsonl): nothing is
downloaded.

Marked ``slow``. lm-eval is not in the ``dev`` extra (it takes minutes to
install and pins older packages): ``pip install -e '.[eval]'`` enables it.
"""

import json
from pathlib import Path

import pytest
import yaml

from tests.server.conftest import MODEL, LiveServer, build_engine, settings

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -e '.[eval]' to run this test")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TASKS = Path(__file__).resolve().parent / "tasks"
LL_ATOL = 1e-4  # per loglikelihood, the issue's bound


def task_configs() -> list[dict]:
    configs = []
    for name in ("specserve_qa_mc", "specserve_qa_gen"):
        config = yaml.safe_load((TASKS / f"{name}.yaml").read_text())
        config["dataset_kwargs"] = {"data_files": str(TASKS / "qa.jsonl")}
        configs.append(config)
    return configs


def evaluate(model: str, model_args: dict) -> dict[str, list[dict]]:
    """Per task, lm-eval's samples (each with the responses ``resps``), in doc order."""
    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=task_configs(), log_samples=True, random_seed=0,
        numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0,
    )
    return {task: sorted(samples, key=lambda s: s["doc_id"]) for task, samples in out["samples"].items()}


def plain_hf_dir(model_dir: Path, out: Path) -> Path:
    """The converted default model as transformers' Auto classes load it: its config
    still names the GGUF file it was dequantized from (``quantization_config``), which
    ``AutoModelForCausalLM.from_pretrained`` refuses without that file. Links the
    weights and tokenizer files, and writes the config without that entry."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_local_completions_equal_hf(monkeypatch, tmp_path, float_engine, default_model_path, session_engines):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    path = str(plain_hf_dir(Path(default_model_path), tmp_path / "model"))
    engine = build_engine(float_engine)  # the float32 checkpoint transformers reads too
    session_engines.append(engine)
    with LiveServer(settings(), engine) as server:
        served = evaluate(
            "local-completions",
            {"model": MODEL, "base_url": f"{server.url}/v1/completions", "tokenizer_backend": "huggingface",
             "tokenizer": path, "num_concurrent": 1, "max_retries": 1},
        )
    hf = evaluate("hf", {"pretrained": path, "dtype": "float32", "device": "cpu", "batch_size": 1})
    assert set(served) == set(hf) == {"specserve_qa_mc", "specserve_qa_gen"}
    mc = list(zip(served["specserve_qa_mc"], hf["specserve_qa_mc"], strict=True))
    assert len(mc) == 8
    for ours, theirs in mc:  # resps: per choice [(loglikelihood, is_greedy)]
        got, want = [r[0] for r in ours["resps"]], [r[0] for r in theirs["resps"]]
        assert len(got) == len(want) == 4
        for (ll, greedy), (ll_hf, greedy_hf) in zip(got, want, strict=True):
            assert abs(ll - ll_hf) <= LL_ATOL, (ours["doc"], ll, ll_hf)
            assert greedy == greedy_hf
    gen = list(zip(served["specserve_qa_gen"], hf["specserve_qa_gen"], strict=True))
    assert len(gen) == 8
    for ours, theirs in gen:
        assert ours["resps"] == theirs["resps"], ours["doc"]
    assert sum(bool(ours["resps"][0][0].strip()) for ours, _ in gen) >= 4  # not all end at once (EOS)
