"""Fault injection for tests: make one stage fail for chosen requests.

``LLMEngine.set_fault_hook(hook)`` installs ``hook(stage, request_ids)``, which
the engine calls before the drafter ("drafter"), the target pass ("model")
and sampling or verification ("sampler") with the ids involved; it raises to
simulate a failure there. No hook is installed in normal operation.
"""

from collections.abc import Callable

FaultHook = Callable[[str, list[str]], None]


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


def fail_for(stage: str, request_ids: set[str]) -> FaultHook:
    """A hook that fails ``stage`` whenever one of ``request_ids`` is involved."""

    def hook(at: str, ids: list[str]) -> None:
        if at == stage and request_ids.intersection(ids):
            raise InjectedFault(f"injected {stage} fault for {sorted(request_ids.intersection(ids))}")

    return hook
