"""Helpers of the distribution tests: the exact processed distribution of a
short continuation, written independently of engine.worker.sampler; the engine run
that samples it many times; the chi-square check.

A request's *processed* next-token distribution applies, as SamplingParams
documents: repetition penalty (prompt and output tokens), presence and
frequency penalties (output tokens), logit_bias, temperature, top-k, top-p
(over the top-k set), min-p; temperature 0 is the argmax after penalties and
bias. ``exact_joint`` enumerates every continuation, so penalties that depend
on the tokens emitted so far are exact too.
"""

import functools
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from engine.config import SpeculativeConfig
from engine.llm_engine import LLMEngine

V = 6
NUM_SAMPLES = 20_000
SETTINGS = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9)]
# (method, settings) of the distribution tests over both drafters: the default suite runs each
# drafter and each setting once, `make test-slow` the other two (as the tree tests do).
METHOD_SETTINGS = [
    pytest.param("ngram", SETTINGS[0], id="ngram-t1.0"),
    pytest.param("ngram", SETTINGS[1], id="ngram-t0.7-p0.9", marks=pytest.mark.slow),
    pytest.param("draft_model", SETTINGS[0], id="draft_model-t1.0", marks=pytest.mark.slow),
    pytest.param("draft_model", SETTINGS[1], id="draft_model-t0.7-p0.9"),
]
PROMPT = [0, 1, 2, 3, 4, 5, 0]  # every token occurs, so prompt lookup always finds a draft
POSITIONS = (1, 2, 3)  # output[0] comes from the prefill; with k = 2, output[3] is the first round's bonus


def processed(logits: np.ndarray, settings: dict, context=(), output=()) -> np.ndarray:
    """The processed distribution [V] of one next-token row of raw ``logits``, after
    ``context`` (prompt and output so far), of which ``output`` is the output."""
    s = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, **settings}
    logits = np.asarray(logits, dtype=np.float64).copy()
    rep = s.get("repetition_penalty", 1.0)
    for t in set(context):
        logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
    counts = np.bincount(np.asarray(output, dtype=np.int64), minlength=len(logits))
    logits -= s.get("frequency_penalty", 0.0) * counts + s.get("presence_penalty", 0.0) * (counts > 0)
    for t, b in (s.get("logit_bias") or {}).items():
        logits[t] += b
    if s["temperature"] == 0:
        return np.eye(len(logits))[logits.argmax()]
    probs = np.exp((logits - logits.max()) / s["temperature"])
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.ones(len(probs), dtype=bool)
    if s["top_k"]:
        keep[order[s["top_k"] :]] = False
    kept = np.where(keep, probs, 0.0) / probs[keep].sum()
    before = np.cumsum(kept[order]) - kept[order]
    keep[order[before >= s["top_p"]]] = False
    keep &= kept >= s["min_p"] * kept.max()
    keep[order[0]] = True
    probs = np.where(keep, probs, 0.0)
    return probs / probs.sum()


def exact_joint(next_logits: Callable[[list[int]], np.ndarray], settings: dict, positions=POSITIONS) -> np.ndarray:
    """P(output[i] for i in ``positions``), shape [V] * len(positions), by enumerating
    every continuation of PROMPT up to the last position. ``next_logits(context)``:
    the target's raw logits after ``context``."""
    joint = np.zeros((V,) * len(positions))

    def walk(output: list[int], prob: float) -> None:
        if len(output) > max(positions):
            joint[tuple(output[i] for i in positions)] += prob
            return
        context = PROMPT + output
        p = processed(next_logits(context), settings, context, output)
        for t in np.flatnonzero(p):
            walk(output + [int(t)], prob * p[t])

    walk([], 1.0)
    return joint


def p_value(counts: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square p-value of observed ``counts`` against ``expected_probs`` (same shape).

    Cells expected below 5 samples are pooled into one. An outcome of probability
    0 that was observed is impossible under the hypothesis: the p-value is 0.
    """
    expected = expected_probs.ravel() * counts.sum()
    observed = counts.ravel()
    if observed[expected_probs.ravel() <= 0].sum() > 0:
        return 0.0
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(obs) < 2:  # a point mass, observed only where expected
        return 1.0
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def make_engine(target, drafter, k: int = 2, adaptive: bool = False, verify_cost: float = 0.1, **tree) -> LLMEngine:
    """``drafter`` None: the target's first layer drafts (early_exit). ``tree``: token-tree
    keys of ``SpeculativeConfig`` (``tree_width``, ``max_tree_nodes``)."""
    method = "test" if drafter is not None else "early_exit"
    config = EngineConfig(
        ModelConfig(device="cpu", dtype="float32", max_model_len=64),
        CacheConfig(block_size=16, num_blocks=3000),
        SchedulerConfig(max_num_seqs=2048, max_num_batched_tokens=16384),
        SpeculativeConfig(
            method=method, num_speculative_tokens=k, num_layers=1, adaptive=adaptive, verify_cost=verify_cost, **tree
        ),
    )
    return LLMEngine(config, model=target, tokenizer=None, drafter=drafter)


class SpecCounts:
    """What speculation did during a run: drafts verified and accepted, and how many
    bonus tokens (every draft of a round accepted) landed at each output position."""

    def __init__(self, engine: LLMEngine):
        self.drafted = self.accepted = 0
        self.bonus: Counter[int] = Counter()
        engine.stat_loggers.append(self._log)
        execute = engine.runner.execute

        def execute_and_count(out, *args):
            before = {s.request_id: engine.scheduler.requests[s.request_id].num_output_tokens for s in out.scheduled}
            result = execute(out, *args)
            for rid, k in result.num_draft_tokens.items():
                if result.num_accepted[rid] == k:
                    self.bonus[before[rid] + k] += 1  # the drafts took positions before .. before + k - 1
            return result

        engine.runner.execute = execute_and_count

    def _log(self, stats) -> None:
        self.drafted += stats.spec.num_draft_tokens
        self.accepted += stats.spec.num_accepted_tokens


def run_groups(engine: LLMEngine, groups: list[tuple[SamplingParams, int]]) -> tuple[list[list[list[int]]], SpecCounts]:
    """Runs ``n`` requests of PROMPT for each ``(params, n)`` of ``groups``, interleaved
    so that every step batches requests of every group. Returns each group's outputs
    and the run's SpecCounts; checks that every KV block came back."""
    spec = SpecCounts(engine)
    order = [(g, i) for i in range(max(n for _, n in groups)) for g, (_, n) in enumerate(groups) if i < n]
    reqs = [(g, engine.add_request(f"g{g}-r{i}", PROMPT, groups[g][0])) for g, i in order]
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks
    outputs: list[list[list[int]]] = [[] for _ in groups]
    for g, r in reqs:
        outputs[g].append(r.output_token_ids)
    return outputs, spec


def joint_counts(outputs: list[list[int]], positions=POSITIONS) -> np.ndarray:
    counts = np.zeros((V,) * len(positions))
    for out in outputs:
        counts[tuple(out[i] for i in positions)] += 1
    return counts


def sample_joint(engine: LLMEngine, settings: dict, num_samples: int, positions=POSITIONS) -> np.ndarray:
    """Joint counts of the output tokens at ``positions`` over ``num_samples`` requests;
    checks that drafts were both accepted and rejected along the way, and that some
    rounds accepted every draft and added a bonus token at a measured position."""
    params = SamplingParams(max_tokens=max(positions) + 1, ignore_eos=True, **settings)
    (outputs,), spec = run_groups(engine, [(params, num_samples)])
    assert spec.drafted >= num_samples  # about one round of up to k drafts per request
    assert 0.05 < spec.accepted / spec.drafted < 0.95, (spec.accepted, spec.drafted)
    assert sum(spec.bonus[i] for i in positions) > num_samples // 20, spec.bonus
    return joint_counts(outputs, positions)


def resample_from_p(p, q):
    """The classic bug, patched in as ``residual_distribution`` to show a test's power:
    after a rejection, sample from p instead of the residual."""
    return p


# ---- a tiny multi-layer Llama whose first layer drafts for it (early exit, EAGLE) ----


def tiny_llama(seed: int = 0, hidden_size: int = 32):
    """``hidden_size``: a multiple of 32 (quantized rows of several 32-weight blocks past 32); the
    weights scale with 1/sqrt(hidden_size / 32), so every size has logits of the same order."""
    from transformers import LlamaConfig

    from engine.models.decoder import LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V, hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    scale = (32 / hidden_size) ** 0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            # Later layers get smaller weights, so the first layer alone is a fair draft.
            std = 0.5 if "embed" in name or "lm_head" in name else 0.3 if "layers.0." in name else 0.25
            param.copy_(torch.randn(param.shape, generator=gen) * std * (1.0 if "embed" in name else scale))
            if "norm" in name:
                param.fill_(1.0)
    return model.eval()


def llama_logits(model):
    """``context -> the model's raw next-token logits`` from one fresh prefill, memoized, by
    the forward that ``make_engine``'s engine runs (its default attention backend: on a CPU
    with the C kernels, one C call per layer), so the expected distribution is the one a
    plain decode samples. Another forward differs in the last bits, and in quantized
    layers a last bit can move an activation's 8-bit code and the logits far more."""
    from engine.attention import SeqSpec
    from engine.attention.backends import select_backend
    from engine.models.decoder import head_dim_of
    from kvcache.tensors import KVSpec, PagedKV

    cfg = model.config
    build_attention_metadata = select_backend("auto", torch.device("cpu"), torch.float32).build_metadata

    @functools.cache
    def logits(context: tuple[int, ...]) -> np.ndarray:
        spec = KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), 16, torch.float32)
        kv = PagedKV(spec, 4, "cpu")
        meta = build_attention_metadata([SeqSpec(0, len(context), [0, 1, 2, 3])], 16)
        with torch.inference_mode():
            hidden = model(torch.tensor(context), torch.arange(len(context)), meta, kv)
            return model.compute_logits(hidden[-1:])[0].double().numpy()

    return lambda context: logits(tuple(context))
