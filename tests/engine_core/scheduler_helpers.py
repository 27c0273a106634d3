"""Scheduler test helpers (vLLM's tests/v1/core/utils.py is the model): the real Scheduler
and KVCacheManager with a tiny KV spec, plain Requests, and a fake runner that returns
chosen tokens. No model."""

from engine.config import SchedulerConfig
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.core.scheduler import RunnerOutput, Scheduler
from kvcache import KVCacheManager

EOS = 99


def create_scheduler(
    num_blocks=16, block_size=2, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
    enable_prefix_caching=False,
):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, kv, max_model_len)


def create_request(rid: str, prompt_len: int, max_tokens: int = 8, **kw) -> Request:
    prompt = [(hash(rid) + i) % 50 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), frozenset({EOS}))


def fake_token(req: Request) -> int:
    """A deterministic 'model': the next token depends only on the request's tokens."""
    return (sum(req.token_ids) * 31 + len(req.token_ids)) % 50


def check_runner_tables(sched: Scheduler, out, tables: dict[str, list[int]]) -> None:
    """Applies ``out``'s block changes to ``tables`` as the runner does (request id -> its
    copy), and checks that each copy equals the scheduler's table."""
    for s in out.scheduled:
        table = tables.setdefault(s.request_id, [])
        del table[s.block_start :]
        table.extend(s.new_block_ids)
        assert table == sched.kv.block_table(s.request_id), s.request_id


def step(sched: Scheduler, tokens: dict[str, int] | None = None):
    """schedule -> fake runner -> update; returns the SchedulerOutput. The fake runner
    keeps its block tables from the per-step changes alone, as the real one does."""
    out = sched.schedule()
    check_runner_tables(sched, out, sched.__dict__.setdefault("runner_tables", {}))
    sampled = {
        s.request_id: [tokens[s.request_id] if tokens and s.request_id in tokens else fake_token(sched.requests[s.request_id])]
        for s in out.scheduled
        if s.sample
    }
    sched.update(out, RunnerOutput(sampled))
    return out


def counts(out) -> dict[str, tuple[int, int, bool]]:
    """request id -> (context_len, tokens computed this step, sample)."""
    return {s.request_id: (s.context_len, len(s.token_ids), s.sample) for s in out.scheduled}


def assert_all_free(sched: Scheduler):
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    assert not sched.running and not sched.waiting and not sched.requests
