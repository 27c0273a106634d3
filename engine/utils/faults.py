"""Fault injection: ``LLMEngine.set_fault_hook(hook)`` installs ``hook(stage, request_ids)``,
which the engine calls before the drafter ("drafter"), the target pass ("model") and
sampling or verification ("sampler") with the ids involved; it raises to simulate a
failure there (``tests/faults.py`` builds such hooks). No hook is installed in normal
operation.
"""

from collections.abc import Callable

FaultHook = Callable[[str, list[str]], None]
