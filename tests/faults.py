"""Fault hooks for ``LLMEngine.set_fault_hook`` (``engine.utils.faults``): make one stage fail for chosen requests."""

from engine.utils.faults import FaultHook


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


def fail_for(stage: str, request_ids: set[str]) -> FaultHook:
    """A hook that fails ``stage`` whenever one of ``request_ids`` is involved."""

    def hook(at: str, ids: list[str]) -> None:
        if at == stage and request_ids.intersection(ids):
            raise InjectedFault(f"injected {stage} fault for {sorted(request_ids.intersection(ids))}")

    return hook
