"""Speculative decoding's one home: what the engine knows of speculation.

- ``speculator``: the ``Speculator``, the engine's one owner of the drafter, the policy
  and the cost tracker (plan, propose, record);
- ``drafter``: the draft types (``DraftSlot``, ``Draft``) and the ``Drafter`` interface;
- ``registry``: the one mapping from a method name to its drafter's factory;
- ``policy``: how many drafts each request verifies in a step (``SpecPolicy``);
- ``cost_tracker``: the step-cost table ``T(R)`` the policy prices drafts with;
- ``tree_policy``: which tree shape a round verifies;
- ``rejection_sampler``, ``tree_sampler``: verification of chains and trees.

Concrete drafters live in the top-level ``drafters`` package and import these
modules; nothing here imports a concrete drafter except the registry, lazily.
Token trees as plain data (``engine.utils.tree``) sit below this package: the attention
backends build tree masks from them too.
"""
