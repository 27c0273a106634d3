"""``specserve serve --headless``: a node other than node 0 runs its tensor-parallel
ranks and nothing else (no HTTP server, no scheduler). It starts one worker process
per rank of the node (``ParallelConfig.node_ranks``), each joining node 0's group
at ``--master-addr:--master-port``, and lives as long as they do: it exits 0 when
they all end after rank 0's Shutdown, 1 as soon as one fails (the others are
stopped with it), so that a supervisor (a LeaderWorkerSet, systemd) restarts the
group. SIGTERM stops the workers and exits 0.
"""

import logging
import multiprocessing as mp
import signal
import time

from engine.config import ParallelConfig
from engine.distributed.executor import READY_TIMEOUT_S
from engine.distributed.messages import Rendezvous
from engine.distributed.worker import worker_main

log = logging.getLogger(__name__)

POLL_S = 0.2


def run_headless(parallel: ParallelConfig) -> int:
    """Runs this node's workers until they end; the process exit status."""
    ctx = mp.get_context("spawn")
    procs = []
    for local_rank, rank in enumerate(parallel.node_ranks):
        rdv = Rendezvous(rank, local_rank, parallel.tensor_parallel_size, parallel.master_addr, parallel.master_port,
                         READY_TIMEOUT_S)
        procs.append(ctx.Process(target=worker_main, args=(rdv, parallel.ranks_per_node), name=f"specserve-tp{rank}"))
    terminated = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    for p in procs:
        p.start()
    log.info("headless node %d of %d: ranks %s, group at %s:%d", parallel.node_rank, parallel.nnodes,
             list(parallel.node_ranks), parallel.master_addr, parallel.master_port)
    while any(p.is_alive() for p in procs) and not terminated:
        failed = [p for p in procs if p.exitcode not in (None, 0)]
        if failed:
            log.error("worker %s exited with %s: stopping this node", failed[0].name, failed[0].exitcode)
            break
        time.sleep(POLL_S)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    status = 0 if terminated or all(p.exitcode == 0 for p in procs) else 1
    log.info("headless node %d exits with %d", parallel.node_rank, status)
    return status
