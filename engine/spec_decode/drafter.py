"""The one interface every drafter implements, and the draft types it speaks.

Drafters (the ``drafters`` package) import this module; the engine builds them
through ``engine.spec_decode.registry`` and never imports one by name.

Per step, before scheduling, the engine asks ``context_class`` of each decoding
request (the policy plans the step's draft slots from it, see
``engine.spec_decode.policy``); after scheduling it calls ``propose`` once with
the requests that got draft slots. After verification it calls ``commit`` with
each request's final token count, so a drafter with a KV cache of its own can
roll back the entries of rejected drafts; ``free`` when a request ends. When
``propose`` raises, the engine calls ``rollback`` for each request and drafts it
alone; ``free`` ends the drafter's state of a request that fails by itself.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.core.request import Request


@dataclass(frozen=True)
class DraftSlot:
    request: "Request"  # read-only: committed token_ids and sampling params
    num_draft_tokens: int  # at most this many drafts (decided before drafting: non-anticipating)
    # The target's block table, with KV slots reserved for the last committed token
    # (at position len(request.token_ids) - 1) and the drafts after it. Only a drafter
    # that shares the target's cache reads it.
    block_table: tuple[int, ...] = ()
    # A token tree's template (engine.utils.tree parent list, chosen by the policy before drafting):
    # the draft may be any tree whose nodes fit it, cut to num_draft_tokens nodes. None: a chain.
    shape: tuple[int, ...] | None = None


@dataclass
class Draft:
    """A chain of drafts, or a token tree over ``token_ids`` (``engine.utils.tree``: a parent
    index per node, parents first, best-ranked sibling first)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] q each draft was sampled from; None: one-hot
    parents: tuple[int, ...] | None = None  # None: a chain


class Drafter(ABC):
    #: q is one-hot at the proposed token (prompt lookup); False: drafts carry ``probs``.
    deterministic: bool = True
    #: Cost of drafting one token, in target decode steps (the speculation policy's ``c``).
    cost_per_token: float = 0.0

    def context_class(self, request: "Request") -> int | None:
        """A class of ``request``'s committed context for the speculation policy, which
        keeps acceptance statistics per class; None: nothing to propose now. Must not
        depend on what would be drafted, only on the context (default: one class)."""
        return 0

    @abstractmethod
    def propose(self, slots: list[DraftSlot]) -> dict[str, Draft]:
        """Drafts for some of the slots (a request may get none), keyed by request id."""

    #: Target layer ids whose hidden states the drafter reads (see ``LlamaForCausalLM.forward``'s
    #: ``capture``); the engine then hands it those of every committed position via ``add_features``.
    feature_layers: tuple[int, ...] = ()

    def add_features(self, features: dict[str, tuple[int, torch.Tensor]]) -> None:
        """After a step: request id -> (first position, features [n, F]) of the positions the
        target computed and kept this step (prefill chunks and accepted drafts)."""

    def commit(self, request: "Request") -> None:
        """``request.token_ids`` are final up to their current length; called after every step."""

    def rollback(self, request: "Request") -> None:
        """``propose`` failed part-way: return ``request`` to where its last ``commit`` left
        it (caches, random streams), so that it can be drafted again this step."""
        self.commit(request)

    def free(self, request_id: str) -> None:
        """The request ended (or its drafting failed); drop everything held for it."""
