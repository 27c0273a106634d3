"""The start-up cost table on fake CUDA: a kernel launch returns before the GPU has
run it, so every timed pass must be bracketed by synchronizations, or the table
measures launches and verification looks free."""

import time

import torch

from engine.spec_decode import cost_tracker
from tests.gpu_fake.engines import cuda_engine, cuda_model
from tests.gpu_fake.fake_cuda import fake_cuda


def test_each_timed_pass_starts_and_ends_synchronized(monkeypatch):
    with fake_cuda() as gpu:
        engine = cuda_engine(cuda_model())
        events = []
        real_clock = time.perf_counter
        monkeypatch.setattr(cost_tracker.time, "perf_counter", lambda: events.append("clock") or real_clock())
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync") or gpu.synchronize(*a))
        costs = cost_tracker.measure_step_costs(engine.model, engine.runner, max_rows=3, block_size=16, max_len=256,
                                                repeats=1)
        assert costs.rows == (1, 2, 3) and costs.one_token_s > 0
        clocks = [i for i, e in enumerate(events) if e == "clock"]
        assert len(clocks) == 2 * 4  # the warm-up and three rows, a start and an end each
        assert all(i > 0 and events[i - 1] == "sync" for i in clocks), events
