"""The model runner: one batched forward per step, then sampling or verification.

It turns a ``SchedulerOutput`` (plus the step's drafts) into flat input tensors
built in numpy and copied once, runs the target ONCE over every scheduled token
(prefill chunks, decodes, and each decode's draft chain), computes logits only
at the positions that sample (and at the prompt positions of requests that ask
for prompt logprobs), and then either samples one token per request (no
drafts) or verifies the drafts (``engine.spec_decode.verify``).

Rows: a request with ``k`` drafts contributes ``k + 1`` logit rows, row ``i``
being the target's distribution after the first ``i`` drafts::

    tokens fed:  t_last  d1  d2  d3        (k = 3)
    logit row:   0       1   2   3         row i predicts the token after d_i

A draft may be a token tree (``engine.utils.tree``): the ``k`` nodes are fed in node
order, each at position ``context_len + 1 + depth`` and attending to the
prefix and its own ancestors (``SeqSpec.parents``); row ``i + 1`` is the
target's distribution after node ``i``'s branch. After verification the
accepted path's KV entries are moved to the slots a plain decode would have
written (``kvcache.tensors.move_slots``), so the scheduler keeps or rolls back
a tree exactly as a chain::

    tree (-1, -1, 0, 1), accepted path nodes 1, 3:
    slot of position:  c   c+1  c+2  c+3  c+4
    before:            t   n0   n1   n2   n3
    after:             t   n1   n3   ..   ..      (c+3, c+4: rolled back)

State: the runner sees each request whole once (``SchedulerOutput.new_requests``)
and then only per-step changes; it keeps what sampling needs (parameters,
token ids for penalties, block table, generator) in a ``RequestState`` keyed
by request id, until the engine's release path calls ``free``. Applying a
step's changes is idempotent (tables and tokens are cut at the step's start,
then extended), so a failed step can be run again request by request.

Structured outputs reach the runner as data: per request, the grammar's
bitmask rows for this step (``execute``'s ``grammar_masks``), computed
engine-side where the grammar matchers live.
"""

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention import SeqSpec
from engine.attention.backends import TORCH, AttentionBackend
from engine.layers.cpu_kernels import argmax_rows
from engine.outputs import TokenLogprob
from engine.worker.sampler import (
    apply_bitmask,
    build_sampling_batch,
    compute_logprobs,
    exponential_noise,
    penalized_logits,
    plain_greedy,
    processed_probs,
    sample,
)
from engine.sampling_params import SamplingParams
from engine.core.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput
from engine.utils import tree
from engine.utils.ranges import ranges
from engine.spec_decode.drafter import Draft
from engine.spec_decode.verify import Verified, greedy_rule, verify
from engine.utils.transfer import to_device
from kvcache.manager import slot_mapping
from kvcache.tensors import PagedKV, move_slots


@dataclass
class RequestState:
    """What the runner keeps of one request between steps."""

    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    token_ids: list[int]  # prompt, then every token computed or sampled so far (penalties read it)
    block_table: list[int] = field(default_factory=list)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class ModelRunner:
    def __init__(self, model, kv: PagedKV, block_size: int, device: torch.device, seed: int = 0,
                 attention: AttentionBackend = TORCH):
        self.model = model
        self.attention = attention  # builds each step's attention metadata (engine.attention.backends)
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.config.vocab_size
        self.requests: dict[str, RequestState] = {}
        self.generators: dict[str, torch.Generator] = {}  # per seeded request, kept across preemption
        self._grammar_masks: dict[str, torch.Tensor] = {}  # this step's, see execute
        self.fault_hook = None  # tests: called as hook(stage, request_ids); see engine.utils.faults
        self.feature_layers: tuple[int, ...] = ()  # the drafter's (Drafter.feature_layers)
        self.bucketed = None  # engine.worker.cuda_graphs.BucketedForward: decodes and chains on static buffers
        torch.manual_seed(seed)

    def free(self, request_id: str) -> None:
        """The request ended: drop its state (the engine's release path calls this)."""
        self.requests.pop(request_id, None)
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, drafts: dict[str, Draft] | None = None, grammar_masks: dict | None = None
    ) -> RunnerOutput:
        """One step. ``grammar_masks``: request id -> the grammar's bitmask rows of a structured
        request that samples, [k + 1, ceil(vocab / 32)] int32, row p after its first p drafts
        (``engine.worker.sampler.grammar_bitmask``)."""
        self._apply_changes(out)
        self._grammar_masks = grammar_masks or {}
        drafts = drafts or {}
        sched = out.scheduled
        chains = [s.token_ids + tuple(drafts[s.request_id].token_ids if s.request_id in drafts else ()) for s in sched]
        if self.fault_hook:
            self.fault_hook("model", [s.request_id for s in sched])
        trees = [_fed_tree(s, drafts.get(s.request_id)) for s in sched]
        logits, rows, prompt_logprobs, features = self._forward(sched, chains, trees)
        if logits is None:
            result = RunnerOutput({}, prompt_logprobs=prompt_logprobs)
        else:
            result = self._sample_or_verify(logits, [sched[i] for i in rows], drafts)
            result.prompt_logprobs = prompt_logprobs
        if features is not None:
            result.features = kept_features(features, sched, chains, result)
        return result

    def _sample_or_verify(self, logits: torch.Tensor, sched: list[ScheduledRequest], drafts: dict[str, Draft]) -> RunnerOutput:
        """logits [R, vocab] of the sampling requests' rows -> their new tokens."""
        requests = [self.requests[s.request_id] for s in sched]
        if self.fault_hook:
            self.fault_hook("sampler", [r.request_id for r in requests])
        row_drafts = [drafts.get(r.request_id) for r in requests]
        if not any(row_drafts):
            result = self._sample(logits, requests)
        else:
            if logits.is_cuda:  # the forward's queued kernels are the step's cost, not verification's
                torch.cuda.synchronize(logits.device)
            start = time.perf_counter()
            result = self._verify(logits, sched, row_drafts)
            result.verify_s = time.perf_counter() - start
        for rid, tokens in result.sampled.items():
            self.requests[rid].token_ids.extend(tokens)
        return result

    def _apply_changes(self, out: SchedulerOutput) -> None:
        """The step's new requests and per-request changes (idempotent: see the module doc)."""
        for n in out.new_requests:
            if n.request_id not in self.requests:
                ids = list(n.prompt_token_ids)
                self.requests[n.request_id] = RequestState(n.request_id, n.params, len(ids), ids)
        for s in out.scheduled:
            st = self.requests[s.request_id]
            del st.block_table[s.block_start :]
            st.block_table.extend(s.new_block_ids)
            # The prompt came whole with the request (prompt logprobs score a chunk against the
            # next one's first token); past the prompt, what follows this chunk is stale.
            end = s.context_len + len(s.token_ids)
            st.token_ids[s.context_len : end] = s.token_ids
            del st.token_ids[max(end, st.num_prompt_tokens) :]

    def _forward(self, sched: tuple[ScheduledRequest, ...], chains: list[tuple[int, ...]], trees: list):
        """One target pass. Returns logits [R, vocab] of the sampling rows, the
        index (into ``sched``) of each sampling request, the prompt logprobs
        of this step's chunks (``_prompt_logprobs``), and the drafter's features
        [T, F] of every token fed (None when it reads none)."""
        query_lens = np.array([len(c) for c in chains], dtype=np.int64)
        input_ids = np.fromiter((t for c in chains for t in c), dtype=np.int64, count=int(query_lens.sum()))
        positions = _positions(sched, query_lens, trees)
        tables = [self.requests[s.request_id].block_table for s in sched]
        specs = [SeqSpec(s.context_len, len(c), b, t) for s, c, b, t in zip(sched, chains, tables, trees)]
        bucket = self.bucketed.bucket_for(specs) if self.bucketed and not self.feature_layers else None
        if bucket is not None:  # static buffers, a CUDA graph's replay where captured
            hidden, features = self.bucketed.forward(bucket, specs, input_ids), None
        elif self.feature_layers:  # hidden [T, hidden], features [T, F]
            hidden, features = self.model(*self._inputs(specs, input_ids, positions), self.kv, capture=self.feature_layers)
        else:
            hidden, features = self.model(*self._inputs(specs, input_ids, positions), self.kv), None
        prompt_logprobs = self._prompt_logprobs(hidden, sched, query_lens)
        rows = [i for i, s in enumerate(sched) if s.sample]
        if not rows:
            return None, rows, prompt_logprobs, features
        # k + 1 rows per sampling request: its last scheduled token and its drafts.
        num_rows = np.array([len(chains[i]) - len(sched[i].token_ids) + 1 for i in rows], dtype=np.int64)
        idx = ranges(np.cumsum(query_lens)[rows] - num_rows, num_rows)
        return self.model.compute_logits(hidden[self._t(idx)]), rows, prompt_logprobs, features

    def _inputs(self, specs: list[SeqSpec], input_ids: np.ndarray, positions: np.ndarray) -> tuple:
        """(ids [T], positions [T], metadata) of an eager step."""
        meta = self.attention.build_metadata(specs, self.block_size, self.device)
        return self._t(input_ids), self._t(positions), meta

    def _prompt_logprobs(self, hidden: torch.Tensor, sched, query_lens: np.ndarray) -> dict[str, tuple[int, list]]:
        """Logprobs of the prompt tokens that this step's chunks predict, for the
        requests whose params ask (``scores_prompt``): the row at position p scores
        prompt token p + 1, for p + 1 < num_prompt_tokens (the last prompt row
        predicts the first output token: it samples). hidden [T, hidden].

        Returns request id -> (p_first, entries): entry j scores prompt token
        p_first + 1 + j, i.e. it is ``Request.prompt_logprobs[p_first + j]``.
        Example: a 5-token prompt in chunks of 3 and 2 gives rows 0-2 (tokens
        1-3) then row 3 (token 4); its last row 4 samples.
        """
        starts = np.cumsum(query_lens) - query_lens
        idx, targets, spans = [], [], []
        for i, s in enumerate(sched):
            req = self.requests[s.request_id]
            end = min(s.context_len + len(s.token_ids), req.num_prompt_tokens - 1)  # positions < end score
            if not req.params.scores_prompt or end <= s.context_len:
                continue
            idx.extend(range(starts[i], starts[i] + end - s.context_len))
            targets.extend(req.token_ids[s.context_len + 1 : end + 1])
            spans.append((req, s.context_len, end - s.context_len))
        if not idx:
            return {}
        logits = self.model.compute_logits(hidden[self._t(np.array(idx))])  # [len(idx), vocab]
        top_n = max(req.params.prompt_logprobs for req, _, _ in spans)
        lps = compute_logprobs(logits, to_device(targets, self.device, torch.long), top_n, rank=True)
        out, j = {}, 0
        for req, start, n in spans:
            n_top = req.params.prompt_logprobs
            entries = [TokenLogprob(lp.token_id, lp.logprob, lp.top[:n_top], lp.rank) for lp in lps[j : j + n]]
            out[req.request_id] = (start, entries)
            j += n
        return out

    def _sample(self, logits: torch.Tensor, requests: list[RequestState]) -> RunnerOutput:
        """Plain decoding: one token per request. logits [n, vocab]; logprobs are of the raw
        logits, the sample of the grammar-masked ones."""
        if self._argmax_only(requests):
            # the greedy rule without drafts: argmax (the first maximum) in a third of its time
            tokens = argmax_rows(logits)
            return RunnerOutput({r.request_id: [t] for r, t in zip(requests, tokens)})
        batch = build_sampling_batch(requests, self.vocab_size, self.device, self._generators(requests))
        tokens = sample(self._masked(logits, [(r.request_id, 0) for r in requests]), batch)
        result = RunnerOutput({r.request_id: [t] for r, t in zip(requests, tokens.tolist())})
        if batch.num_logprobs is not None:
            self._add_logprobs(result, logits, tokens, requests, batch.num_logprobs)
        return result

    def _verify(self, logits: torch.Tensor, sched: list[ScheduledRequest], drafts: list[Draft | None]) -> RunnerOutput:
        """Every request's drafts (chains or trees) verified at once (``engine.spec_decode.verify``),
        then the accepted tree paths' KV moved. logits [R, vocab] with R = sum(k_r + 1) rows,
        request by request (``engine.spec_decode.metadata``)."""
        requests = [self.requests[s.request_id] for s in sched]
        num_logprobs = None
        if self._argmax_only(requests):  # the argmax of the raw logits: no sampling batch needed
            verified = greedy_rule(argmax_rows(logits), drafts)  # argmax, as above
        else:
            verified, num_logprobs, rows = self._verify_processed(logits, requests, drafts)
        self._keep_accepted_paths(sched, verified.paths)
        result = RunnerOutput({}, num_draft_tokens={}, num_accepted={})
        for i, (r, d) in enumerate(zip(requests, drafts)):
            result.sampled[r.request_id] = verified.tokens[i]
            if d is not None and d.token_ids:
                result.num_draft_tokens[r.request_id] = len(d.token_ids)
                result.num_accepted[r.request_id] = len(verified.paths[i])
                if verified.paths[i] and d.parents is not None:
                    result.accepted_nodes[r.request_id] = verified.paths[i]
        if num_logprobs is not None:
            self._add_chain_logprobs(result, logits, *rows, requests, num_logprobs, verified)
        return result

    def _verify_processed(self, logits: torch.Tensor, requests: list[RequestState], drafts: list[Draft | None]):
        """``verify`` on the processed rows (grammar masks, penalties counting the drafts before
        each row, temperature and the rest), with each request's randomness. Returns the
        verdict, the most logprobs a request asks (None: none) and (request, row within it) of
        each row."""
        num_draft_tokens = [len(d.token_ids) if d else 0 for d in drafts]
        num_rows = np.array(num_draft_tokens, dtype=np.int64) + 1  # [n] k + 1 rows per request
        row_req = np.repeat(np.arange(len(requests)), num_rows)  # [R] request of each row
        row_pos = ranges(np.zeros(len(requests), dtype=np.int64), num_rows)  # [R] row within its request
        branches = [tree.path_tokens(d.token_ids, d.parents, len(d.token_ids)) if d else [[]] for d in drafts]
        rows = list(zip(row_req.tolist(), row_pos.tolist()))  # plain ints: indexing by numpy scalars is slow
        prefixes = [tuple(branches[i][p]) for i, p in rows]
        batch = build_sampling_batch([requests[i] for i, _ in rows], self.vocab_size, self.device,
                                     [None] * len(rows), prefixes)
        masked = self._masked(logits, [(requests[i].request_id, p) for i, p in rows])
        greedy = [r.params.greedy for r in requests]
        argmax = penalized_logits(masked, batch).argmax(-1) if any(greedy) else None  # [R]
        probs = uniforms = noise = None
        sampled = [i for i, g in enumerate(greedy) if not g]
        if sampled:
            probs = processed_probs(masked, batch)  # [R, V]
            uniforms, noise = self._randomness([num_draft_tokens[i] for i in sampled],
                                               self._generators([requests[i] for i in sampled]))
        verified = verify(drafts, greedy, argmax, probs, uniforms, noise)
        return verified, batch.num_logprobs, (row_req, row_pos)

    def _keep_accepted_paths(self, sched: list[ScheduledRequest], paths: list[list[int]]) -> None:
        """Moves each accepted path's KV entries to the positions right after the
        scheduled tokens (node ``i`` was written at offset ``i``, its depth is its
        offset on the path); the scheduler then keeps them as accepted chain drafts."""
        src, dst = [], []
        for s, path in zip(sched, paths):
            if path != list(range(len(path))):
                base = s.context_len + len(s.token_ids)
                table = self.requests[s.request_id].block_table
                src.append(slot_mapping(table, base, base + path[-1] + 1, self.block_size)[path])
                dst.append(slot_mapping(table, base, base + len(path), self.block_size))
        if src:
            move_slots(self.kv, self._t(np.concatenate(src)), self._t(np.concatenate(dst)))


    def _randomness(self, num_draft_tokens: list[int], gens: list[torch.Generator | None]):
        """Uniforms [D] (one per draft, request after request) and Exp(1) noise [n, vocab].
        A seeded request draws its own ``num_draft_tokens[i]`` uniforms from its generator,
        so its draws do not depend on the batch."""
        uniforms = torch.rand(sum(num_draft_tokens), device=self.device)
        start = 0
        for n, g in zip(num_draft_tokens, gens):
            if g is not None:
                uniforms[start : start + n] = torch.rand(n, generator=g, device=self.device)
            start += n
        return uniforms, exponential_noise((len(num_draft_tokens), self.vocab_size), gens, self.device)

    def _add_logprobs(self, result, logits, tokens, requests, top_n) -> None:
        lps = compute_logprobs(logits, tokens, top_n)
        for lp, r in zip(lps, requests):
            if r.params.logprobs is not None:
                result.logprobs.setdefault(r.request_id, []).append(
                    TokenLogprob(lp.token_id, lp.logprob, lp.top[: r.params.logprobs])
                )

    def _add_chain_logprobs(self, result, logits, row_req, row_pos, requests, top_n, verified: Verified) -> None:
        """Logprobs of each emitted token, from the row that predicted it (``Verified.emit_rows``)."""
        order = [{row: j for j, row in enumerate(verified.emit_rows(i))} for i in range(len(requests))]
        keep = [i for i, (r, p) in enumerate(zip(row_req, row_pos)) if p in order[r]]
        tokens = to_device([result.sampled[requests[row_req[i]].request_id][order[row_req[i]][row_pos[i]]] for i in keep],
                           self.device, torch.long)
        self._add_logprobs(result, logits[self._t(np.array(keep))], tokens, [requests[row_req[i]] for i in keep], top_n)

    def _argmax_only(self, requests: list[RequestState]) -> bool:
        """Every request plain greedy (``plain_greedy``: a structured request's grammar mask is
        in ``_grammar_masks``) and asking no logprobs: the argmax of the raw logits is all it needs."""
        return all(plain_greedy(r.params) and r.params.logprobs is None for r in requests)

    def _masked(self, logits: torch.Tensor, rows: list[tuple[str, int]]) -> torch.Tensor:
        """logits [R, vocab] with the tokens outside row j's grammar at -inf, ``rows[j]`` being
        (request id, drafts before the row); ``logits`` itself when no row has a grammar."""
        masks = self._grammar_masks
        if not masks:
            return logits
        idx = [j for j, (rid, _) in enumerate(rows) if rid in masks]
        if not idx:
            return logits
        return apply_bitmask(logits, idx, torch.stack([masks[rows[j][0]][rows[j][1]] for j in idx]))

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return to_device(a, self.device)

    def _generators(self, requests: list[RequestState]) -> list[torch.Generator | None]:
        return [self._generator(r.request_id, r.params) for r in requests]

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        g = self.generators.get(request_id)
        if g is None:
            g = self.generators[request_id] = torch.Generator(self.device).manual_seed(params.seed)
        return g


def _positions(sched, query_lens: np.ndarray, trees: list) -> np.ndarray:
    """[T] position of each token fed: context_len + its offset in a chain, + its depth in a tree."""
    context_lens = np.fromiter((s.context_len for s in sched), dtype=np.int64, count=len(sched))
    positions = ranges(context_lens, query_lens)
    starts = np.cumsum(query_lens) - query_lens
    for start, s, t in zip(starts.tolist(), sched, trees):
        if t is not None:
            positions[start : start + len(t)] = s.context_len + tree.depths(t)
    return positions


def _fed_tree(s: ScheduledRequest, draft: Draft | None) -> tuple[int, ...] | None:
    """The tree over the tokens fed for ``s``: its scheduled tokens as a chain, then
    the draft's nodes hanging from the last of them; None when that is a chain."""
    if draft is None or tree.is_chain(draft.parents):
        return None
    return tree.with_prefix(len(s.token_ids), draft.parents)


def kept_features(features: torch.Tensor, sched, chains, result: RunnerOutput) -> dict[str, tuple[int, torch.Tensor]]:
    """The drafter's features [T, F] of a step, cut to what each request keeps: its
    scheduled tokens and, when it sampled, its accepted drafts (a token tree's accepted
    branch, in order) (request id -> (position of the first, features [n, F]))."""
    out, start = {}, 0
    for s, chain in zip(sched, chains):
        fed, scheduled = len(chain), len(s.token_ids)
        nodes = result.accepted_nodes.get(s.request_id)
        if nodes is None:
            kept = features[start : start + scheduled + result.num_accepted.get(s.request_id, 0)]
        else:
            kept = features[[*range(start, start + scheduled), *(start + scheduled + n for n in nodes)]]
        out[s.request_id] = (s.context_len, kept.clone())
        start += fed
    return out
