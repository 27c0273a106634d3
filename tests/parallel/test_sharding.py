"""Tensor-parallel sharding without extra processes: two ranks as two threads of
this process, each with its own gloo group object and its own shard, loaded from
one checkpoint. Their logits must match the unsharded model's (fast, default suite;
the multi-process engine tests are in ``test_tp_engine.py``)."""

import threading

import pytest
import torch
from transformers import LlamaConfig

from engine.attention import SeqSpec, build_attention_metadata
from engine.config import ParallelConfig
from engine.distributed.group import LOOPBACK, host_store, join_store, make_group
from engine.distributed.model import check_parallel
from engine.distributed.worker import kv_spec
from engine.worker.loader import load_model
from engine.layers.parallel import TPGroup
from kvcache.tensors import PagedKV
from tests.parallel.checkpoints import TINY, save_random_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("tiny"))


@torch.inference_mode()
def prefill_then_decode(model, prompt: list[int]) -> torch.Tensor:
    """Logits [len(prompt) + 1, vocab]: a prefill of ``prompt`` then one decode of token 7,
    which reads the prompt's keys and values back from this rank's KV-cache shard."""
    kv = PagedKV(kv_spec(model, 16, torch.float32), 4, CPU)
    n = len(prompt)
    meta = build_attention_metadata([SeqSpec(0, n, [2, 0])], 16)
    first = model.compute_logits(model(torch.tensor(prompt), torch.arange(n), meta, kv))
    meta = build_attention_metadata([SeqSpec(n, 1, [2, 0])], 16)
    second = model.compute_logits(model(torch.tensor([7]), torch.tensor([n]), meta, kv))
    return torch.cat([first, second])


def run_ranks(path, size: int, prompt: list[int]) -> list[torch.Tensor]:
    store = host_store(LOOPBACK, 0, size, 30)
    out: list = [None] * size

    def rank(r: int) -> None:
        try:
            tp = make_group(store if r == 0 else join_store(LOOPBACK, store.port, size, 30), r, size, "gloo", 30, LOOPBACK)
            out[r] = prefill_then_decode(load_model(path, torch.float32, CPU, tp, 256), prompt)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.mark.parametrize("size", [2, 3])
def test_sharded_logits_match_the_whole_model(checkpoint, size):
    prompt = [3, 141, 59, 26, 5, 358, 97, 93, 23, 84, 62, 64, 33, 83, 27, 9, 50]  # 17 tokens: two KV blocks
    reference = prefill_then_decode(load_model(checkpoint, torch.float32, CPU, max_positions=256), prompt)
    for r, logits in enumerate(run_ranks(checkpoint, size, prompt)):
        assert not isinstance(logits, BaseException), logits
        assert logits.shape == reference.shape
        assert (logits - reference).abs().max().item() < 1e-4, f"rank {r}"
        assert logits.abs().max() > 1  # not trivially small


def test_heads_split_by_whole_kv_heads(checkpoint):
    """3 KV heads over 2 ranks: 2 + 1, each with its 2 query heads; each rank reads its slice."""
    full = load_model(checkpoint, torch.float32, CPU, max_positions=256)
    q_rows = TINY["hidden_size"] // TINY["num_attention_heads"] * 2  # rows of one KV head's query group
    store = host_store(LOOPBACK, 0, 2, 30)
    shards: list = [None, None]

    def rank(r):
        tp = make_group(store if r == 0 else join_store(LOOPBACK, store.port, 2, 30), r, 2, "gloo", 30, LOOPBACK)
        shards[r] = load_model(checkpoint, torch.float32, CPU, tp, 256)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    attn = [s.layers[0].self_attn for s in shards]
    assert [(a.num_heads, a.num_kv_heads) for a in attn] == [(4, 2), (2, 1)]
    whole_q = full.layers[0].self_attn.qkv_proj.weight[: 3 * q_rows]
    torch.testing.assert_close(attn[1].qkv_proj.weight[:q_rows], whole_q[2 * q_rows :])
    whole_o = full.layers[0].self_attn.o_proj.weight
    torch.testing.assert_close(attn[0].o_proj.weight, whole_o[:, : 2 * q_rows])


def test_split_is_as_even_as_it_goes():
    assert [TPGroup(r, 2).split(3, "x") for r in range(2)] == [(0, 2), (2, 1)]
    assert [TPGroup(r, 4).split(10, "x") for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    with pytest.raises(ValueError, match="smaller than tensor-parallel size 4"):
        TPGroup(0, 4).split(3, "num_key_value_heads")


def test_sizes_the_model_cannot_take_fail_clearly():
    config = LlamaConfig(**TINY)
    check_parallel(config, 3, CPU)  # 3 KV heads, vocabulary 516: fits
    with pytest.raises(ValueError, match="3 KV heads; every rank needs at least one"):
        check_parallel(config, 4, CPU)
    with pytest.raises(ValueError, match="vocabulary .515 tokens. does not split evenly"):
        check_parallel(LlamaConfig(**{**TINY, "vocab_size": 515}), 2, CPU)
    with pytest.raises(ValueError, match="at least 1"):
        ParallelConfig(tensor_parallel_size=0)


def test_tensor_parallel_size_flag_and_environment(monkeypatch):
    from tests.server.conftest import settings_from

    monkeypatch.setenv("SPECSERVE_TENSOR_PARALLEL_SIZE", "3")
    assert settings_from([]).engine_config().parallel == ParallelConfig(tensor_parallel_size=3)
    assert settings_from(["--tensor-parallel-size", "2"]).engine_config().parallel.tensor_parallel_size == 2
    with pytest.raises(Exception, match="greater than or equal to 1"):
        settings_from(["--tensor-parallel-size", "0"])
