"""CUDA graphs on fake CUDA (``tests.gpu_fake.fake_graphs``: capture records the region's
kernels, replay reruns them on the same tensors): the engine captures its buckets at start-up
and replays them for decodes and chain verification, with the tokens of ``--enforce-eager``;
a replay runs no Python of the model; graph memory comes out of the KV cache's budget."""

import numpy as np
import pytest
import torch

from engine.attention import SeqSpec
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from engine.worker.cuda_graphs import BucketedForward, graphs_apply
from engine.sampling_params import SamplingParams
from kvcache.tensors import KVSpec, PagedKV
from tests.gpu_fake.engines import cuda_engine, cuda_model, run
from tests.gpu_fake.fake_cuda import fake_cuda, value

CHAINS = SpeculativeConfig(method="ngram", num_speculative_tokens=3, verify_cost=0.05)


@pytest.mark.parametrize("speculative", [None, CHAINS], ids=["decode", "chains"])
def test_engine_replays_graphs_with_the_eager_tokens(speculative):
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)] * 2
    tokens = {}
    for eager in (True, False):
        with fake_cuda() as gpu:
            engine = cuda_engine(cuda_model(echo=True), speculative, enforce_eager=eager, max_num_seqs=4)
            reqs, drafted = run(engine, params)
            tokens[eager] = [r.output_token_ids for r in reqs]
            replays = sum(g.replays for g in gpu.graphs)
            assert (replays == 0) == eager and (not gpu.graphs) == eager
            assert speculative is None or drafted > 0
    assert tokens[False] == tokens[True]


def test_replay_runs_the_captured_kernels_not_the_model():
    """Two different steps of one bucket replayed: each gives what the same bucketed forward
    gives eagerly, bitwise, and the model's Python never runs."""
    with fake_cuda():
        model = cuda_model()
        spec = KVSpec(2, 2, 16, 16, torch.bfloat16)
        kv = PagedKV(spec, 16, "cuda", pad_block=True)
        graphs = BucketedForward(model, "torch_varlen", kv, 64, "cuda", max_requests=2, max_tokens=2, graphs=True)
        graphs.capture_all()
        eager = BucketedForward(model, "torch_varlen", kv, 64, "cuda", max_requests=2, max_tokens=2, graphs=False)
        calls = []
        model.register_forward_pre_hook(lambda *_: calls.append(1))
        for ctx, ids in ((5, [7, 8]), (20, [3, 9])):
            specs = [SeqSpec(ctx, 2, [1, 2])]
            bucket = graphs.bucket_for(specs)
            replayed = value(graphs.forward(bucket, specs, np.array(ids))).clone()
            assert not calls
            assert torch.equal(replayed, value(eager.forward(bucket, specs, np.array(ids))))
            calls.clear()


def test_graph_memory_comes_out_of_the_kv_budget():
    def blocks(eager: bool) -> int:
        with fake_cuda(total_bytes=64 << 20):
            config = EngineConfig(ModelConfig(device="cuda", dtype="bfloat16", max_model_len=256,
                                              attention_backend="torch_varlen", enforce_eager=eager),
                                  CacheConfig(gpu_memory_utilization=0.5), SchedulerConfig(max_num_seqs=8))
            from engine.llm_engine import LLMEngine

            return LLMEngine(config, model=cuda_model()).paged_kv.num_blocks

    assert blocks(eager=False) < blocks(eager=True)


def test_graphs_only_on_cuda_without_enforce_eager():
    def config(eager: bool) -> EngineConfig:
        return EngineConfig(ModelConfig(enforce_eager=eager))

    with fake_cuda():
        m = cuda_model()
        assert graphs_apply(config(False), m, "flash_attn", torch.device("cuda"))
        assert not graphs_apply(config(True), m, "flash_attn", torch.device("cuda"))
        assert not graphs_apply(config(False), m, "torch", torch.device("cuda"))  # no bucketed metadata
    assert not graphs_apply(config(False), m, "cpu", torch.device("cpu"))


def test_enforce_eager_flag():
    from tests.server.conftest import settings_from

    assert settings_from(["--enforce-eager"]).engine_config().model.enforce_eager
    assert not settings_from([]).engine_config().model.enforce_eager
