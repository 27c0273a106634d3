"""Every family split over two tensor-parallel ranks (two threads of this process, each its
own gloo group object and shard, as tests/parallel/test_sharding.py): greedy decoding of
each prompt gives the tokens of the unsplit model, and the prompts' logits agree within
1e-4. Biases split with their rows, Phi-3's fused tensors with each logical matrix's
rows, OLMoE's q/k norms across ranks, experts by rows (every rank a slice of each)."""

import threading

import pytest
import torch

from engine.attention import SeqSpec, build_attention_metadata
from engine.distributed.group import LOOPBACK, host_store, join_store, make_group
from engine.distributed.worker import kv_spec
from engine.worker.loader import load_model
from kvcache.tensors import PagedKV
from tests.models.families import FAMILIES
from tests.models.family_engines import PROMPTS

CPU = torch.device("cpu")
NEW_TOKENS = 12


@torch.inference_mode()
def greedy_with_logits(model) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt prefilled in two chunks (a decode step reads the first chunk's KV back from
    this rank's shard), then NEW_TOKENS greedy decode steps: (tokens, prompt logits)."""
    kv = PagedKV(kv_spec(model, 16, torch.float32), 8, CPU)
    tokens, logits = [], []
    for ids in PROMPTS:
        half = len(ids) // 2
        table = [5, 1, 6, 2, 7]
        step = lambda new, done: model.compute_logits(model(  # noqa: E731
            torch.tensor(new), torch.arange(done, done + len(new)),
            build_attention_metadata([SeqSpec(done, len(new), table)], 16), kv))
        prompt = torch.cat([step(ids[:half], 0), step(ids[half:], half)])
        logits.append(prompt)
        out = [int(prompt[-1].argmax())]
        for _ in range(NEW_TOKENS - 1):
            out.append(int(step(out[-1:], len(ids) + len(out) - 1)[-1].argmax()))
        tokens.append(out)
    return tokens, logits


def run_ranks(path, size: int) -> list:
    store = host_store(LOOPBACK, 0, size, 60)
    out: list = [None] * size

    def rank(r: int) -> None:
        try:
            tp = make_group(store if r == 0 else join_store(LOOPBACK, store.port, size, 60), r, size, "gloo", 60, LOOPBACK)
            out[r] = greedy_with_logits(load_model(path, torch.float32, CPU, tp, 256))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return out


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_two_ranks_decode_the_tokens_of_one(name, tiny_checkpoint):
    path = tiny_checkpoint(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # both sides; the ranks' threads share the cores
    try:
        tokens, logits = greedy_with_logits(load_model(path, torch.float32, CPU, max_positions=256))
        results = run_ranks(path, 2)
    finally:
        torch.set_num_threads(threads)
    for r, result in enumerate(results):
        assert not isinstance(result, BaseException), result
        assert result[0] == tokens, f"rank {r}"
        for got, ref in zip(result[1], logits, strict=True):
            assert (got - ref).abs().max().item() < 1e-4, f"rank {r}"
