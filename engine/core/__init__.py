"""The engine core beneath ``LLMEngine``: requests and their state (``request``,
``detokenizer``, ``stop``), the scheduler, and the per-step statistics. Imports no torch."""
