"""Helpers shared by the engine-core tests: driving an engine to completion,
running our model outside the engine, and the exact processed distribution
(written here in numpy, independently of engine.worker.sampler) with its chi-square
check."""

from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import chisquare

from engine.attention import SeqSpec, build_attention_metadata
from engine.models.decoder import head_dim_of
from engine.outputs import RequestOutput
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from kvcache.tensors import KVSpec, PagedKV


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    kw.setdefault("ignore_eos", True)
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


@dataclass
class Finished:
    request: Request
    deltas: list[RequestOutput]

    @property
    def token_ids(self) -> list[int]:
        return self.request.output_token_ids

    @property
    def text(self) -> str:
        return self.request.output_text

    @property
    def finish_reason(self) -> str | None:
        return self.request.finish_reason

    @property
    def streamed_text(self) -> str:
        return "".join(d.new_text for d in self.deltas)

    @property
    def streamed_token_ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.new_token_ids]


def run(engine, prompts, params, prefix: str = "req") -> list[Finished]:
    """Adds every prompt (text or token ids), steps until all finish, and
    returns each request with the deltas ``engine.step`` gave for it."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    assert not engine.has_unfinished()
    reqs = [engine.add_request(f"{prefix}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    deltas: dict[str, list[RequestOutput]] = {r.request_id: [] for r in reqs}
    while engine.has_unfinished():
        outs = engine.step()
        assert outs or engine.scheduler.running, "the engine stalled: requests wait, none runs"
        for out in outs:
            deltas[out.request_id].append(out)
    for r in reqs:
        assert r.is_finished and deltas[r.request_id][-1].finished
    return [Finished(r, deltas[r.request_id]) for r in reqs]


def scratch_cache(model, num_blocks: int, block_size: int = 16, dtype: torch.dtype | None = None) -> PagedKV:
    """A private paged KV cache for running ``model`` outside an engine (``dtype``: default the model's)."""
    cfg = model.config
    weight = model.norm.weight  # (a quantized model's matrices are on meta: their blocks live elsewhere)
    spec = KVSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim_of(cfg), block_size, dtype or weight.dtype)
    return PagedKV(spec, num_blocks, weight.device)


@torch.inference_mode()
def forward_logits(model, kv: PagedKV, specs: list[SeqSpec], token_ids: list[list[int]]) -> list[torch.Tensor]:
    """One forward over several requests' new tokens; logits [query_len, vocab] of each."""
    bs = kv.spec.block_size
    ids = torch.tensor([t for ts in token_ids for t in ts])
    positions = torch.cat([torch.arange(s.context_len, s.context_len + s.query_len) for s in specs])
    hidden = model(ids, positions, build_attention_metadata(specs, bs), kv)
    return list(model.compute_logits(hidden).split([s.query_len for s in specs]))


def prompt_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Logits [len, vocab] of one prompt, from a single prefill of our model."""
    bs = 16
    n = -(-len(token_ids) // bs)
    kv = scratch_cache(model, n, bs)
    return forward_logits(model, kv, [SeqSpec(0, len(token_ids), list(range(n)))], [token_ids])[0]


# ---- the exact processed distribution, and a chi-square check against it ----


def expected_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The processed distribution of one row of logits, in float64: temperature,
    then top-k, then the smallest prefix of the top-k set (renormalized) whose
    mass reaches top_p, and tokens below min_p times the largest probability
    removed; the kept tokens renormalized."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    k = top_k if top_k else len(p)
    in_top_k = p[order[:k]] / p[order[:k]].sum()
    n_top_p = min(int(np.searchsorted(np.cumsum(in_top_k), top_p)) + 1, k)
    keep = order[:n_top_p]
    keep = keep[p[keep] >= min_p * p[order[0]]]
    out = np.zeros_like(p)
    out[keep] = p[keep] / p[keep].sum()
    return out


def chi_square_p_value(samples, probs: np.ndarray) -> float:
    """p-value of the samples (token ids) under ``probs``, with bins of expected
    count >= 5 (the rarer tokens merged into one tail bin). A sample of a token
    outside the support gives 0."""
    samples = np.asarray(samples)
    n = len(samples)
    observed = np.bincount(samples, minlength=len(probs)).astype(np.float64)
    if observed[probs == 0].sum() > 0:
        return 0.0
    expected = n * probs
    big = expected >= 5
    obs_bins, exp_bins = list(observed[big]), list(expected[big])
    tail_obs, tail_exp = observed[~big].sum(), expected[~big].sum()
    if tail_exp >= 5:
        obs_bins.append(tail_obs)
        exp_bins.append(tail_exp)
    elif tail_exp > 0:  # too rare for a bin of its own: merge into the smallest bin
        i = int(np.argmin(exp_bins))
        obs_bins[i] += tail_obs
        exp_bins[i] += tail_exp
    assert len(exp_bins) >= 2, "the distribution has too few bins for a chi-square test"
    exp_bins = np.array(exp_bins) * (n / np.sum(exp_bins))  # exact total despite float rounding
    return float(chisquare(obs_bins, exp_bins).pvalue)


ALPHA = 1e-4  # false-alarm rate of one chi-square check (the tests are seeded, so deterministic anyway)


def assert_distribution(samples, probs: np.ndarray, alpha: float = ALPHA) -> None:
    p = chi_square_p_value(samples, probs)
    assert p > alpha, f"samples do not follow the expected distribution (chi-square p = {p:.3g})"
