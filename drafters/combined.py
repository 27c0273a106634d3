"""``ngram+eagle`` / ``ngram+eagle3`` / ``suffix+eagle3``: a lookup drafter (prompt lookup, or
suffix decoding) where it has paid, the EAGLE head elsewhere.

Per request and step, before drafting (the choice sees only the committed context and
past records, so verification stays exact): when the context has a suffix match of
length n (the lookup drafter's context class, 1 and up), the lookup drafts if its class n
has so far emitted at least as many
tokens per unit of cost as the head has (a class with no record yet is tried: its
drafts cost nothing); otherwise the head drafts. The choice is the context class the
speculation policy keeps its statistics by: n for prompt lookup, ``EAGLE_CLASS`` (0)
for the head. The records are this drafter's own: per class, running means of the
drafts proposed and accepted per round, pooled over requests; a seeded request
chooses by records of its own rounds only (starting empty), so that its choices,
and so its output, do not depend on other traffic.

The head reads the target's features every step, whichever drafter proposed, so it
is caught up when its turn comes.
"""

from dataclasses import dataclass

from engine.utils import tree
from engine.spec_decode.drafter import Draft, Drafter, DraftSlot
from drafters.eagle import EagleDrafter, eagle_factory, memory_needs  # noqa: F401 - the head's, for the registry
from drafters.ngram import NgramDrafter
from drafters.suffix import from_config as suffix_from_config

EAGLE_CLASS = 0  # the lookup drafters' classes are match lengths, 1 and up
EMA = 0.1


@dataclass
class _Record:
    drafted: float = 0.0  # running means per round
    accepted: float = 0.0
    rounds: int = 0

    def update(self, drafted: int, accepted: int) -> None:
        w = max(EMA, 1.0 / (self.rounds + 1))
        self.drafted += w * (drafted - self.drafted)
        self.accepted += w * (accepted - self.accepted)
        self.rounds += 1

    def value(self, cost_per_token: float) -> float:
        """Tokens a round emits per unit of cost (a plain step costs 1)."""
        return (1 + self.accepted) / (1 + self.drafted * cost_per_token)


class CombinedDrafter(Drafter):
    deterministic = False

    def __init__(self, lookup: Drafter, eagle: EagleDrafter):
        self.lookup, self.eagle = lookup, eagle  # lookup: deterministic, context classes >= 1
        self.cost_per_token = eagle.cost_per_token  # the policy prices every class at the head's cost
        self.feature_layers = eagle.feature_layers
        self.records: dict[int, _Record] = {}  # pooled over the requests
        self.own: dict[str, dict[int, _Record]] = {}  # a seeded request's: request id -> class -> record
        self.choice: dict[str, int] = {}  # request id -> class chosen at scheduling
        self.proposed: dict[str, tuple[int, int, Draft]] = {}  # id -> (class, num_tokens, drafts)

    def context_class(self, request) -> int | None:
        m = self.lookup.context_class(request)
        head = self.eagle.context_class(request)
        if m is not None and (head is None or self._lookup_pays(m, self._records(request))):
            key = m
        else:
            key = None if head is None else EAGLE_CLASS
        if key is None:
            self.choice.pop(request.request_id, None)
        else:
            self.choice[request.request_id] = key
        return key

    def _records(self, request) -> dict[int, _Record]:
        if request.params.seed is None:
            return self.records
        return self.own.setdefault(request.request_id, {})

    def _lookup_pays(self, n: int, records: dict[int, _Record]) -> bool:
        mine, head = records.get(n), records.get(EAGLE_CLASS)
        if mine is None or head is None:
            return mine is None or mine.value(0.0) >= 1.0
        return mine.value(0.0) >= head.value(self.eagle.cost_per_token)

    def propose(self, slots: list[DraftSlot]) -> dict[str, Draft]:
        by_head = [s for s in slots if self.choice.get(s.request.request_id) == EAGLE_CLASS]
        by_lookup = [s for s in slots if self.choice.get(s.request.request_id, EAGLE_CLASS) != EAGLE_CLASS]
        drafts = {**self.lookup.propose(by_lookup), **self.eagle.propose(by_head)}
        for s in slots:
            rid = s.request.request_id
            if rid in drafts:
                self.proposed[rid] = (self.choice[rid], s.request.num_tokens, drafts[rid])
        return drafts

    def add_features(self, features) -> None:
        self.eagle.add_features(features)

    def commit(self, request) -> None:
        done = self.proposed.pop(request.request_id, None)
        if done is not None:
            key, start, draft = done
            accepted = _accepted(draft, request.token_ids[start:])
            self.records.setdefault(key, _Record()).update(len(draft.token_ids), accepted)
            if request.params.seed is not None:
                self._records(request).setdefault(key, _Record()).update(len(draft.token_ids), accepted)
        self.lookup.commit(request)
        self.eagle.commit(request)

    def rollback(self, request) -> None:
        self.proposed.pop(request.request_id, None)
        self.lookup.rollback(request)
        self.eagle.rollback(request)

    def free(self, request_id: str) -> None:
        for table in (self.choice, self.proposed, self.own):
            table.pop(request_id, None)
        self.lookup.free(request_id)
        self.eagle.free(request_id)


def _accepted(draft: Draft, new: list[int]) -> int:
    """Drafts of ``draft`` (a chain or a tree) that the committed ``new`` tokens follow."""
    parents = draft.parents or tree.chain(len(draft.token_ids))
    return sum(rank is not None for _, rank in tree.walk(draft.token_ids, parents, new))


def _build(lookup: str, kind: str):
    def factory(spec, **context) -> CombinedDrafter:
        if lookup == "suffix":
            drafter = suffix_from_config(spec)
        else:
            drafter = NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return CombinedDrafter(drafter, eagle_factory(kind)(spec, **context))

    factory.__doc__ = f"{lookup} where its context class has paid, an {kind} head elsewhere."
    return factory


build_ngram_eagle = _build("ngram", "eagle")  # the registry's names (engine.spec_decode.registry)
build_ngram_eagle3 = _build("ngram", "eagle3")
build_suffix_eagle3 = _build("suffix", "eagle3")
