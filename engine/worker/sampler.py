"""Vectorized sampling: logits -> processed distribution p -> tokens.

One row per sampled position. The processed distribution of a row applies, in
this order: repetition penalty (prompt and output tokens), presence and
frequency penalties (output tokens), logit_bias, temperature, top-k, top-p
(over the top-k set, renormalized), min-p. Greedy rows take the argmax after
penalties and bias.

A request with a grammar (structured output) has its logits masked first
(``mask_logits``): tokens the grammar forbids after the row's prefix are at -inf
before any of the processing above, so p is renormalized over the allowed set.

Random rows are drawn by the exponential race ``argmax(p / E)`` with
``E ~ Exp(1)`` i.i.d. per token, which selects token ``x`` with probability
exactly ``p(x)``. A request with a seed draws its ``E`` from its own generator,
so its samples do not depend on what else is in the batch.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.outputs import TokenLogprob
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.utils.transfer import to_device


@dataclass
class SamplingBatch:
    """Per-row sampling settings as tensors; ``n`` rows."""

    temperature: torch.Tensor  # [n] float, 1.0 on greedy rows
    greedy: torch.Tensor  # [n] bool
    top_k: torch.Tensor | None  # [n] long, vocab size where disabled; None: no row uses it
    top_p: torch.Tensor | None  # [n] float; None: no row uses it
    min_p: torch.Tensor | None  # [n] float; None: no row uses it
    penalties: tuple[torch.Tensor, ...] | None  # (presence [n], frequency [n], repetition [n])
    output_counts: torch.Tensor | None  # [n, vocab] float, occurrences in the output so far
    context_mask: torch.Tensor | None  # [n, vocab] bool, token seen in prompt or output
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (rows, token ids, values)
    generators: list[torch.Generator | None]  # per row; None: the shared generator
    num_logprobs: int | None  # max top-N asked by any row; None: no row wants logprobs
    all_greedy: bool = False  # known on the host, so that deciding costs no device sync
    any_greedy: bool = False


def build_sampling_batch(
    requests: list[Request],
    vocab_size: int,
    device,
    generators: list[torch.Generator | None],
    drafted: list[tuple[int, ...]] | None = None,
) -> SamplingBatch:
    """One row per entry of ``requests`` (a request may fill several rows).

    ``drafted[i]`` are draft tokens that precede row i in its context: a
    verification row's penalties count the drafts before it as output tokens.
    """
    params = [r.params for r in requests]
    f = lambda vals: to_device(vals, device, torch.float32)  # noqa: E731
    greedy = to_device([p.greedy for p in params], device, torch.bool)
    temperature = f([1.0 if p.greedy else p.temperature for p in params])
    top_k = top_p = min_p = penalties = counts = seen = bias = None
    if any(p.top_k for p in params):
        top_k = to_device([p.top_k or vocab_size for p in params], device, torch.long)
    if any(p.top_p < 1 for p in params):
        top_p = f([p.top_p for p in params])
    if any(p.min_p > 0 for p in params):
        min_p = f([p.min_p for p in params])
    if any(p.has_penalties for p in params):
        names = ("presence_penalty", "frequency_penalty", "repetition_penalty")
        penalties = tuple(f([getattr(p, a) for p in params]) for a in names)
        counts, seen = _token_counts(requests, drafted or [()] * len(requests), vocab_size, device)
    if any(p.logit_bias for p in params):
        entries = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items() if t < vocab_size]
        rows, toks, vals = zip(*entries) if entries else ((), (), ())
        bias = (to_device(rows, device, torch.long), to_device(toks, device, torch.long), f(vals))
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    flags = [p.greedy for p in params]
    return SamplingBatch(temperature, greedy, top_k, top_p, min_p, penalties, counts, seen, bias, generators,
                         max(wanted, default=None), all(flags), any(flags))


def _token_counts(requests: list[Request], drafted: list[tuple[int, ...]], vocab_size: int, device):
    """Output-token counts [n, vocab] and a mask of every token in the context, each
    filled by one indexed write over all rows (not a write per row)."""
    n = len(requests)
    outputs = [r.output_token_ids + list(extra) for r, extra in zip(requests, drafted)]
    contexts = [r.token_ids + list(extra) for r, extra in zip(requests, drafted)]
    out_rows, out_ids = _flat_index(outputs)
    ctx_rows, ctx_ids = _flat_index(contexts)
    counts = torch.zeros(n, vocab_size, device=device)
    counts.index_put_((to_device(out_rows, device), to_device(out_ids, device)),
                      torch.ones(len(out_ids), device=device), accumulate=True)
    seen = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
    seen[to_device(ctx_rows, device), to_device(ctx_ids, device)] = True
    return counts, seen


def _flat_index(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(row of each entry, entry) of the lists ``rows``, flat: each [sum of lengths] int64."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    return np.repeat(np.arange(len(rows), dtype=np.int64), lengths), ids


def penalized_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Penalties and logit_bias applied. logits [n, vocab] float32 -> [n, vocab]."""
    if b.penalties is not None:
        presence, frequency, repetition = (t.unsqueeze(1) for t in b.penalties)
        rep = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(b.context_mask, rep, logits)
        logits = logits - frequency * b.output_counts - presence * (b.output_counts > 0)
    if b.bias is not None:
        rows, toks, vals = b.bias
        logits = logits.index_put((rows, toks), vals, accumulate=True)
    return logits


PREFIX = 256  # on the CPU, the best tokens ranked by topk first: a full sort of the vocabulary takes 30x as long


def processed_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Logits of the processed distribution p (removed tokens at -inf). [n, vocab]."""
    logits = penalized_logits(logits, b) / b.temperature.unsqueeze(1)
    if b.top_k is None and b.top_p is None and b.min_p is None:
        return logits
    if logits.device.type == "cpu" and logits.shape[-1] > PREFIX and (b.top_k is None or bool((b.top_k <= PREFIX).all())):
        # Every row's kept set lies among its PREFIX best tokens where their last is removed (the
        # removals only grow along the ranks); p's mass is still over the whole vocabulary.
        best, order = logits.topk(PREFIX, dim=-1)  # [n, PREFIX], descending
        log_mass = None if b.top_k is not None else logits.logsumexp(-1, keepdim=True)
        remove = _removed(best, b, log_mass)
        if bool(remove[:, -1].all()):
            kept = best.masked_fill(remove, -torch.inf)
            return torch.full_like(logits, -torch.inf).scatter(1, order, kept)
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, vocab]
    return logits.scatter(1, order, sorted_logits.masked_fill(_removed(sorted_logits, b), -torch.inf))


def _removed(sorted_logits: torch.Tensor, b: SamplingBatch, log_mass: torch.Tensor | None = None) -> torch.Tensor:
    """Which of each row's tokens, ranked by ``sorted_logits`` [n, m] (descending, the first m of
    the vocabulary's), top-k, top-p and min-p remove (the best one never). p over those m tokens
    (after top-k), or, given ``log_mass`` [n, 1] (the log of the whole vocabulary's mass), over all."""
    ranks = torch.arange(sorted_logits.shape[-1], device=sorted_logits.device).unsqueeze(0)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if b.top_k is not None:
        remove |= ranks >= b.top_k.unsqueeze(1)
    if b.top_p is not None or b.min_p is not None:
        if log_mass is None:
            probs = sorted_logits.masked_fill(remove, -torch.inf).softmax(-1)
        else:
            probs = (sorted_logits - log_mass).exp()
        if b.top_p is not None:  # keep the smallest prefix whose mass reaches top_p
            remove |= (probs.cumsum(-1) - probs) >= b.top_p.unsqueeze(1)
        if b.min_p is not None:
            remove |= probs < b.min_p.unsqueeze(1) * probs[:, :1]
    remove[:, 0] = False
    return remove


def processed_probs(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """The processed distribution p of each row. [n, vocab].

    A row with no finite logit left (extreme penalties or biases) would be NaN;
    it becomes one-hot at its raw argmax instead (chosen on the device: no host sync).
    """
    probs = processed_logits(logits, b).softmax(-1)
    bad = ~torch.isfinite(probs.sum(-1, keepdim=True))  # [n, 1]: a NaN anywhere makes the row's sum NaN
    if probs.device.type == "cpu" and not bool(bad.any()):  # (a device would sync for it)
        return probs
    fallback = torch.zeros_like(probs).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(bad, fallback, probs)


def exponential_noise(shape: tuple[int, int], generators: list, device) -> torch.Tensor:
    """i.i.d. Exp(1) noise [n, vocab]; row i from ``generators[i]`` when given."""
    noise = torch.empty(shape, device=device)
    if any(g is None for g in generators):  # the shared generator's rows (all drawn: one call)
        noise.exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise


def plain_greedy(params: SamplingParams) -> bool:
    """Greedy with nothing that changes the logits (penalties, logit_bias, a grammar): the
    token after a context is the argmax of the model's raw logits there, which needs no
    sampling batch (the first maximum, as ``sample`` takes it)."""
    return params.greedy and not params.has_penalties and not params.logit_bias and params.guided is None


def sample(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """One token per row. logits [n, vocab] float32 -> token ids [n] long."""
    return sample_with_probs(logits, b)[0]


def sample_with_probs(logits: torch.Tensor, b: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sample``'s tokens [n] and the processed distribution p [n, vocab] the random rows
    were drawn from (a drafter's q); None when every row is greedy (nothing drawn)."""
    if b.all_greedy:
        return penalized_logits(logits, b).argmax(-1), None
    probs = processed_probs(logits, b)
    noise = exponential_noise(probs.shape, b.generators, probs.device)
    random = (probs / noise).argmax(-1)
    if not b.any_greedy:
        return random, probs
    return torch.where(b.greedy, penalized_logits(logits, b).argmax(-1), random), probs


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int, rank: bool = False) -> list[TokenLogprob]:
    """Logprobs of the model's raw distribution: the chosen token's and the top ``top_n``;
    with ``rank``, also the chosen token's rank (1 + the number of likelier tokens).
    logits [n, vocab], tokens [n] on the logits' device. Everything reaches the host in
    one copy (float64 holds every token id exactly): one sync on a GPU, not one per row."""
    logp = logits.log_softmax(-1)
    chosen = logp.gather(1, tokens.unsqueeze(1))  # [n, 1]
    cols = [tokens.unsqueeze(1), chosen]
    if rank:
        cols.append((logp > chosen).sum(-1, keepdim=True) + 1)
    if top_n:
        top_vals, top_ids = logp.topk(top_n, dim=-1)  # [n, top_n] each
        cols += [top_ids, top_vals]
    rows = torch.cat([c.double() for c in cols], dim=1).tolist()  # [n, 2 + rank + 2 * top_n]
    out = []
    for row in rows:
        r = 3 if rank else 2
        top = tuple(zip(map(int, row[r : r + top_n]), row[r + top_n :])) if top_n else ()
        out.append(TokenLogprob(int(row[0]), row[1], top, int(row[2]) if rank else None))
    return out


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [n, ceil(V / 32)] -> bool [n, V] (bit ``j`` of word ``w`` is token ``32 w + j``)."""
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [n, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def mask_logits(logits: torch.Tensor, requests: Sequence, prefixes: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """``logits`` [n, V] with the tokens outside each row's grammar (``engine.worker.grammar``, the
    rule and why it keeps speculation exact) at -inf; row i belongs to
    ``requests[i]``, after its committed tokens plus ``prefixes[i]`` (drafts). Rows of
    requests without a grammar are untouched; with no grammar at all this returns
    ``logits`` itself at the cost of one scan of ``requests``."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return logits
    grammars = [requests[i].grammar for i in rows]
    bitmask = grammar_bitmask(grammars, [prefixes[i] if prefixes else () for i in rows], logits.shape[-1])
    return apply_bitmask(logits, rows, bitmask)


def grammar_bitmask(grammars: Sequence, prefixes: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    """Allowed tokens of each grammar after ``prefixes[i]``, packed 32 per int32 (xgrammar's
    layout). [len(grammars), ceil(vocab / 32)] int32."""
    bitmask = torch.full((len(grammars), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    for j, (grammar, prefix) in enumerate(zip(grammars, prefixes)):
        grammar.fill(bitmask, j, prefix)
    return bitmask


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [n, V] with row ``rows[j]``'s tokens outside ``bitmask[j]`` at -inf (a copy)."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1]).to(logits.device)  # [len(rows), V]
    index = to_device(rows, logits.device, torch.long)
    out = logits.clone()
    out[index] = logits[index].masked_fill(~allowed, -torch.inf)
    return out
