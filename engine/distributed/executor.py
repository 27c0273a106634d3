"""Rank 0's handle on the other tensor-parallel ranks: it hosts the group's store,
starts node 0's other ranks, waits for every rank (those of other nodes come from
``specserve serve --headless``), sends them typed messages, and watches them.

Failure: a watchdog thread checks every ``WATCH_S`` that each local worker is alive
and that every worker's heartbeat count moves. A dead or hung worker, or any error
inside a call the ranks run together, marks the group failed (``failure``), kills
the local workers (so that a collective still waiting on them fails at once rather
than at the group's timeout) and sets the store's ``stop`` key (the workers of
other nodes exit on it). From then on every call raises ``WorkerFailure``;
``LLMEngine.check_health`` raises it too, which stops the engine loop (the server
then answers 503). The group is not rebuilt: restart the server and the headless
nodes (a LeaderWorkerSet restarts the whole group).
"""

import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass

from engine.config import ParallelConfig
from engine.distributed.channel import Channel, Handshake
from engine.distributed.group import LOOPBACK, gloo_address, host_store, make_control_group, make_group
from engine.distributed.messages import Rendezvous, Shutdown, WorkerInit
from engine.distributed.worker import worker_main
from engine.layers.parallel import TPGroup

log = logging.getLogger(__name__)

WATCH_S = 0.5  # watchdog period
READY_TIMEOUT_S = 600.0  # a worker still joining or loading its shard after this long fails the start-up
JOIN_S = 5.0  # grace for a worker to exit after Shutdown


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died or hung, or the ranks fell out of step."""


@dataclass
class _Worker:
    rank: int
    process: mp.Process


class TPWorkers:
    """Hosts the group of ``parallel`` and starts node 0's workers; joins rank 0 to the
    groups once every rank has joined (``group``); ``wait_ready`` then waits for their shards."""

    def __init__(self, init: WorkerInit, parallel: ParallelConfig):
        self.heartbeat_timeout_s = parallel.heartbeat_timeout_s
        self.size = parallel.tensor_parallel_size
        self.failure: str | None = None
        self._lock = threading.Lock()  # the failure, and the store (one client, several threads)
        self._stop = threading.Event()
        addr = LOOPBACK if parallel.nnodes == 1 else parallel.master_addr
        self._store = host_store(addr, parallel.master_port, self.size, init.collective_timeout_s)
        self._handshake = Handshake(self._store)
        self._handshake.publish("init", init)
        self.workers = [self._spawn(rank, addr, parallel.ranks_per_node) for rank in parallel.node_ranks[1:]]
        if parallel.nnodes > 1:
            log.info("tensor parallelism: waiting for nodes 1 .. %d at %s:%d", parallel.nnodes - 1, addr, self._store.port)
        try:
            self._expect("joined")
            address = gloo_address(addr, self._store.port)
            self.group: TPGroup = make_group(self._store, 0, self.size, init.backend, init.collective_timeout_s, address)
            self.channel = Channel(make_control_group(self._store, 0, self.size, init.collective_timeout_s, address))
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, rank: int, addr: str, local_size: int) -> _Worker:
        rdv = Rendezvous(rank, rank, self.size, addr, self._store.port, READY_TIMEOUT_S)
        proc = mp.get_context("spawn").Process(
            target=worker_main, args=(rdv, local_size), name=f"specserve-tp{rank}", daemon=True
        )
        proc.start()
        return _Worker(rank, proc)

    def wait_ready(self) -> None:
        """Waits until every worker has loaded its shard, then starts the watchdog."""
        self._expect("ready")
        threading.Thread(target=self._watch, name="specserve-tp-watchdog", daemon=True).start()

    def _expect(self, state: str) -> None:
        """Waits for ``state`` from every worker; raises what a worker reports instead."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        local = {w.rank: w.process for w in self.workers}
        for rank in range(1, self.size):
            while not self._handshake.has(state, rank):
                if self._handshake.has("failed", rank):
                    error = self._handshake.read("failed", rank)
                    raise WorkerFailure(f"tensor-parallel worker rank {rank} failed to start:\n{error}")
                proc = local.get(rank)
                if (proc is not None and not proc.is_alive()) or time.monotonic() > deadline:
                    code = proc.exitcode if proc is not None else "unknown: on another node"
                    raise WorkerFailure(f"tensor-parallel worker rank {rank} did not start (exit code {code})")
                time.sleep(0.05)

    def send(self, msg) -> None:
        """Sends one message to every worker; raises WorkerFailure when the group has failed."""
        self.check()
        try:
            self.channel.send(msg)
        except Exception as e:  # a broken connection: a worker is gone
            self.fail(f"could not reach the tensor-parallel workers: {type(e).__name__}: {e}")
            raise WorkerFailure(self.failure) from e

    def run(self, fn, *args):
        """Rank 0's part of a call that every rank runs; an error here leaves the ranks
        out of step (they wait in a collective rank 0 never reaches), so it fails the group."""
        try:
            return fn(*args)
        except Exception as e:
            self.fail(f"a tensor-parallel call failed on rank 0: {type(e).__name__}: {e}")
            raise WorkerFailure(self.failure) from e

    def check(self) -> None:
        if self.failure is not None:
            raise WorkerFailure(self.failure)

    def fail(self, reason: str) -> None:
        """Marks the group failed (first reason wins), kills the local workers and tells
        the others to exit."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            try:
                self._store.set("stop", reason)
            except Exception:  # noqa: BLE001 - the failure is recorded either way
                pass
        log.error("tensor parallelism failed: %s", reason)
        self._stop.set()
        for w in self.workers:
            w.process.kill()

    def shutdown(self) -> None:
        """Stops every worker (Shutdown, then kill after ``JOIN_S``) and waits for the local ones."""
        with self._lock:
            polite = self.failure is None
            self.failure = self.failure or "the tensor-parallel workers were shut down"
        self._stop.set()
        if polite and hasattr(self, "channel"):
            try:
                self.channel.send(Shutdown())
            except Exception:  # noqa: BLE001 - a worker already gone
                pass
        for w in self.workers:
            w.process.join(JOIN_S)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()

    def _watch(self) -> None:
        beats = {rank: (-1, time.monotonic()) for rank in range(1, self.size)}
        while not self._stop.wait(WATCH_S):
            reason = self._find_failure(beats)
            if reason is not None:
                self.fail(reason)
                return

    def _find_failure(self, beats: dict) -> str | None:
        for w in self.workers:
            if not w.process.is_alive():
                return f"tensor-parallel worker rank {w.rank} exited (exit code {w.process.exitcode})"
        now = time.monotonic()
        for rank, (count, since) in beats.items():
            with self._lock:
                current = self._store.add(f"beat/{rank}", 0)
            if current != count:
                beats[rank] = (current, now)
            elif now - since > self.heartbeat_timeout_s:
                return f"tensor-parallel worker rank {rank} hung (no heartbeat for {now - since:.1f} s)"
        return None
