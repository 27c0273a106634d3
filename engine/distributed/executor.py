"""Rank 0's handle on the other tensor-parallel ranks: it starts them, sends them
typed messages, and watches them.

Failure: a watchdog thread checks every ``WATCH_S`` that each worker is alive
and that its heartbeat is fresh. A dead or hung worker, or any error inside a
call the ranks run together, marks the group failed (``failure``) and kills
every worker, so that a collective still waiting on them fails at once rather
than at the group's timeout. From then on every call raises ``WorkerFailure``;
``LLMEngine.check_health`` raises it too, which stops the engine loop (the
server then answers 503). The group is not rebuilt: restart the server.
"""

import logging
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass, replace

from engine.distributed.group import host_store, make_group
from engine.distributed.messages import Joining, LoadFailed, Ready, Shutdown, WorkerInit
from engine.distributed.worker import worker_main
from engine.parallel import TPGroup

log = logging.getLogger(__name__)

WATCH_S = 0.5  # watchdog period
READY_TIMEOUT_S = 600.0  # a worker still loading its shard after this long fails the start-up
JOIN_S = 5.0  # grace for a worker to exit after Shutdown


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died or hung, or the ranks fell out of step."""


@dataclass
class _Worker:
    rank: int
    process: mp.Process
    conn: object  # rank 0's end of the pipe (multiprocessing Connection)
    heartbeat: object  # shared double: the worker's last time.monotonic() stamp


class TPWorkers:
    """Starts ranks 1 .. N-1 from ``init`` (rank 0's own ``WorkerInit``) and joins
    rank 0 to their group (``group``); ``wait_ready`` then waits for their shards."""

    def __init__(self, init: WorkerInit, heartbeat_timeout_s: float):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._store = host_store(init.world_size, init.collective_timeout_s)
        ctx = mp.get_context("spawn")
        self.workers: list[_Worker] = []
        for rank in range(1, init.world_size):
            ours, theirs = ctx.Pipe()
            beat = ctx.Value("d", time.monotonic())
            worker = replace(init, rank=rank, store_port=self._store.port, device=_rank_device(init.device, rank))
            proc = ctx.Process(target=worker_main, args=(worker, theirs, beat), name=f"specserve-tp{rank}", daemon=True)
            proc.start()
            theirs.close()
            self.workers.append(_Worker(rank, proc, ours, beat))
        try:
            self._expect(Joining)
            self.group: TPGroup = make_group(self._store, 0, init.world_size, init.backend, init.collective_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def wait_ready(self) -> None:
        """Waits until every worker has loaded its shard, then starts the watchdog."""
        self._expect(Ready)
        threading.Thread(target=self._watch, name="specserve-tp-watchdog", daemon=True).start()

    def _expect(self, kind: type) -> None:
        """Waits for a ``kind`` message from every worker; raises what a worker reports instead."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for w in self.workers:
            while not w.conn.poll(WATCH_S):
                if not w.process.is_alive() or time.monotonic() > deadline:
                    code = w.process.exitcode
                    raise WorkerFailure(f"tensor-parallel worker rank {w.rank} did not start (exit code {code})")
            msg = w.conn.recv()
            if isinstance(msg, LoadFailed):
                raise WorkerFailure(f"tensor-parallel worker rank {w.rank} failed to start:\n{msg.error}")
            if not isinstance(msg, kind):
                raise WorkerFailure(f"tensor-parallel worker rank {w.rank} sent {msg!r}, expected {kind.__name__}")

    def send(self, msg) -> None:
        """Sends one message to every worker; raises WorkerFailure when the group has failed."""
        self.check()
        try:
            for w in self.workers:
                w.conn.send(msg)
        except OSError as e:  # a closed pipe: the worker is gone
            self.fail(f"could not reach a tensor-parallel worker: {e}")
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
        """Marks the group failed (first reason wins) and kills every worker."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        log.error("tensor parallelism failed: %s", reason)
        self._stop.set()
        for w in self.workers:
            w.process.kill()

    def shutdown(self) -> None:
        """Stops every worker (Shutdown, then kill after ``JOIN_S``) and waits for them."""
        with self._lock:
            polite = self.failure is None
            self.failure = self.failure or "the tensor-parallel workers were shut down"
        self._stop.set()
        for w in self.workers:
            if polite:
                try:
                    w.conn.send(Shutdown())
                except OSError:
                    pass
        for w in self.workers:
            w.process.join(JOIN_S)
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_S):
            reason = self._find_failure()
            if reason is not None:
                self.fail(reason)
                return

    def _find_failure(self) -> str | None:
        now = time.monotonic()
        for w in self.workers:
            if not w.process.is_alive():
                return f"tensor-parallel worker rank {w.rank} exited (exit code {w.process.exitcode})"
            silent = now - w.heartbeat.value
            if silent > self.heartbeat_timeout_s:
                return f"tensor-parallel worker rank {w.rank} hung (no heartbeat for {silent:.1f} s)"
        return None


def _rank_device(device: str, rank: int) -> str:
    """One GPU per rank, counting from rank 0's (``--device cuda:N``: rank r on ``cuda:N+r``);
    every CPU rank on the CPU."""
    if not device.startswith("cuda"):
        return "cpu"
    first = int(device.partition(":")[2] or 0)
    return f"cuda:{first + rank}"
