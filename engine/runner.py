"""The model runner: one batched forward per step, then sampling.

It turns a ``SchedulerOutput`` into flat input tensors (built in numpy, copied
once), runs the target once over every scheduled token, computes logits only at
the positions that sample, and samples them.
"""

import numpy as np
import torch

from engine.attention import SeqSpec, build_attention_metadata
from engine.outputs import TokenLogprob
from engine.sampler import build_sampling_batch, compute_logprobs, sample
from engine.sampling_params import SamplingParams
from engine.scheduler import RunnerOutput, SchedulerOutput
from kvcache.tensors import PagedKV


class ModelRunner:
    def __init__(self, model, kv: PagedKV, block_size: int, device: torch.device, seed: int = 0):
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = device
        self.vocab_size = model.config.vocab_size
        self.generators: dict[str, torch.Generator] = {}  # per seeded request, kept across preemption
        torch.manual_seed(seed)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        for rid in out.finished_ids:
            self.generators.pop(rid, None)
        sched = out.scheduled
        query_lens = np.array([len(s.token_ids) for s in sched], dtype=np.int64)
        input_ids = np.fromiter((t for s in sched for t in s.token_ids), dtype=np.int64, count=int(query_lens.sum()))
        positions = np.concatenate([np.arange(s.context_len, s.context_len + len(s.token_ids)) for s in sched])
        specs = [SeqSpec(s.context_len, len(s.token_ids), list(s.block_table)) for s in sched]
        meta = build_attention_metadata(specs, self.block_size, self.device)
        hidden = self.model(self._t(input_ids), self._t(positions), meta, self.kv)  # [T, hidden]
        rows = [i for i, s in enumerate(sched) if s.sample]
        if not rows:
            return RunnerOutput({})
        last = np.cumsum(query_lens)[rows] - 1
        logits = self.model.compute_logits(hidden[self._t(last)])  # [S, vocab]
        requests = [sched[i].request for i in rows]
        batch = build_sampling_batch(
            requests, self.vocab_size, self.device, [self._generator(r.request_id, r.params) for r in requests]
        )
        tokens = sample(logits, batch)
        ids = [r.request_id for r in requests]
        result = RunnerOutput({rid: [t] for rid, t in zip(ids, tokens.tolist())})
        if batch.num_logprobs is not None:
            lps = compute_logprobs(logits, tokens, batch.num_logprobs)
            result.logprobs = {
                r.request_id: [TokenLogprob(lp.token_id, lp.logprob, lp.top[: r.params.logprobs])]
                for lp, r in zip(lps, requests)
                if r.params.logprobs is not None
            }
        return result

    def _t(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        g = self.generators.get(request_id)
        if g is None:
            g = self.generators[request_id] = torch.Generator(self.device).manual_seed(params.seed)
        return g
