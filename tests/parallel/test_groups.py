"""The pieces of a group spread over nodes, without extra processes (fast): which ranks
a node runs, the settings that refuse a group that cannot form, and the control
channel carrying rank 0's messages to ranks in other threads."""

import threading

import numpy as np
import pytest
from pydantic import ValidationError

from engine.attention import SeqSpec
from engine.config import ParallelConfig
from engine.distributed.channel import Channel
from engine.distributed.group import LOOPBACK, gloo_address, host_store, join_store, make_control_group
from engine.distributed.messages import ForwardStep, Shutdown
from server.settings import ServerSettings


def test_each_node_runs_its_slice_of_the_ranks():
    nodes = [ParallelConfig(tensor_parallel_size=8, nnodes=2, node_rank=r, master_port=29500) for r in range(2)]
    assert [list(n.node_ranks) for n in nodes] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert ParallelConfig(tensor_parallel_size=2).node_ranks == range(0, 2)


@pytest.mark.parametrize("flags, message", [
    ({"tensor_parallel_size": 3, "nnodes": 2, "master_port": 29500}, "does not split"),
    ({"tensor_parallel_size": 2, "nnodes": 2}, "master-port"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2, "master_port": 29500, "headless": True}, "node_rank"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 1, "master_port": 29500}, "--headless"),
    ({"tensor_parallel_size": 2, "nnodes": 2, "master_port": 29500, "headless": True}, "--headless"),
])
def test_settings_refuse_a_group_that_cannot_form(flags, message):
    with pytest.raises(ValidationError, match=message):
        ServerSettings(**flags)


def test_a_worker_node_setting_is_accepted():
    s = ServerSettings(tensor_parallel_size=4, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29500,
                       headless=True)
    assert list(s.engine_config().parallel.node_ranks) == [2, 3]


def test_gloo_binds_loopback_on_one_machine_and_the_route_to_node_0_otherwise():
    assert gloo_address("127.0.0.1", 29500) == LOOPBACK
    assert gloo_address("127.0.0.2", 29500) == "127.0.0.1"  # the loopback route, not a literal copy


def test_the_channel_delivers_rank_0s_messages_in_order_to_every_rank():
    size = 3
    store = host_store(LOOPBACK, 0, size, 30)
    sent = [ForwardStep(np.arange(5), np.arange(5), [SeqSpec(0, 5, [1])], None),
            ForwardStep(np.zeros(70_000, dtype=np.int64), np.ones(3), [], 2), Shutdown()]
    received: list = [None] * size

    def rank(r: int) -> None:
        s = store if r == 0 else join_store(LOOPBACK, store.port, size, 30)
        channel = Channel(make_control_group(s, r, size, 30, LOOPBACK))
        if r == 0:
            for msg in sent:
                channel.send(msg)
        else:
            received[r] = [channel.recv() for _ in sent]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for got in received[1:]:
        assert [type(m) for m in got] == [type(m) for m in sent]
        assert np.array_equal(got[1].input_ids, sent[1].input_ids) and got[1].num_layers == 2
        assert got[0].specs == sent[0].specs
