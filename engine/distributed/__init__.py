"""Tensor parallelism across processes: rank 0's model proxy (``model``), the
workers' start, messages and watchdog (``executor``, ``messages``, ``worker``) and
the process group (``group``)."""

from engine.distributed.executor import WorkerFailure
from engine.distributed.model import TensorParallelModel, load_target

__all__ = ["TensorParallelModel", "WorkerFailure", "load_target"]
