"""Prompt lookup (n-gram) drafting over the prompt and the output so far.

Rule (Saxena 2023): take the last ``n`` tokens, the suffix; find its most recent
earlier occurrence, one that starts before the suffix itself; propose the up to
``k`` tokens that followed it. Back off to ``n - 1`` ... ``min_n`` when the
suffix never occurred. Example with n = 3, k = 2::

    a b c X a b c Y a b c      suffix "a b c"; last earlier start: index 4
            ^^^^^ followed by "Y a"  -> propose [Y, a]

Each request keeps an index from every n-gram (min_n <= n <= max_n) to its
most recent starts, extended incrementally as tokens commit, so a step costs
O(k + max_n) per request, not O(context).

Token trees (a slot with a ``shape``): the chain above is the first branch;
the continuations after older occurrences of the suffix, then after the
occurrences of shorter suffixes, are merged into a prefix tree (distinct
continuations branch where they first differ), each node having at most as
many children as the shape allows at its depth. Example, suffix "b"::

    a b c d . a b x y . z b c e . b     continuations, most recent first: c e, x y, c d
    tree:   c - e                          (c d shares "c" with c e, so d ranks after e)
             \\- d
            x - y
"""

from engine.utils import tree
from engine.spec_decode.drafter import Draft, Drafter, DraftSlot

MAX_STARTS = 8  # most recent starts kept per n-gram


class NgramIndex:
    """Most recent start of every n-gram of a token list, for n in [min_n, max_n].

    Only n-grams that end before the last token are indexed, so a lookup of the
    current suffix never finds the suffix itself.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its last MAX_STARTS starts, oldest first
        self.num_indexed_ends = 0  # n-grams ending at positions < this are indexed

    def extend(self, tokens: list[int]) -> None:
        for end in range(self.num_indexed_ends, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                starts = self.starts.setdefault(tuple(tokens[end - n + 1 : end + 1]), [])
                starts.append(end - n + 1)
                if len(starts) > MAX_STARTS:
                    del starts[0]
        self.num_indexed_ends = max(self.num_indexed_ends, len(tokens) - 1)

    def matches(self, tokens: list[int]):
        """``(n, start)`` of every earlier occurrence of a suffix: longest suffix first,
        most recent occurrence first."""
        self.extend(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            for start in reversed(self.starts.get(tuple(tokens[-n:]), ())):
                yield n, start

    def match(self, tokens: list[int]) -> tuple[int, int] | None:
        """``(n, start)`` of the longest suffix with an earlier occurrence, or None."""
        return next(self.matches(tokens), None)

    def continuations(self, tokens: list[int], depth: int, limit: int) -> list[list[int]]:
        """Up to ``limit`` distinct continuations of up to ``depth`` tokens, in ``matches`` order."""
        out: list[list[int]] = []
        for n, start in self.matches(tokens):
            cont = tokens[start + n : start + n + depth]
            if cont and cont not in out:
                out.append(cont)
                if len(out) == limit:
                    break
        return out

    def propose(self, tokens: list[int], k: int) -> list[int]:
        m = self.match(tokens)
        return tokens[m[0] + m[1] : m[0] + m[1] + k] if m else []


class NgramDrafter(Drafter):
    deterministic = True
    cost_per_token = 0.0

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}
        self.matches: dict[str, tuple[int, tuple[int, int] | None]] = {}  # id -> (num_tokens, match)

    def context_class(self, request) -> int | None:
        """The length of the suffix match (longer matches predict better); None: no match."""
        m = self._match(request)
        return m[0] if m else None

    def propose(self, slots: list[DraftSlot]) -> dict[str, Draft]:
        out = {}
        for slot in slots:
            tokens = slot.request.token_ids
            m = self._match(slot.request)
            if not m:
                continue
            if slot.shape is None:
                n, start = m
                out[slot.request.request_id] = Draft(tokens[start + n : start + n + slot.num_draft_tokens])
            else:
                out[slot.request.request_id] = self._tree(slot)
        return out

    def _tree(self, slot: DraftSlot) -> Draft:
        """The continuations merged into a prefix tree that fits the slot's shape."""
        widths = tree.max_widths(slot.shape[: slot.num_draft_tokens])
        index = self.indexes[slot.request.request_id]
        paths = index.continuations(slot.request.token_ids, len(widths), limit=2 * max(widths) * len(widths))
        token_ids, parents = tree.merge_paths(paths, slot.num_draft_tokens, widths)
        return Draft(token_ids, None, None if tree.is_chain(parents) else parents)

    def _match(self, request) -> tuple[int, int] | None:
        """The match for the request's current tokens, computed once per step."""
        rid, num = request.request_id, request.num_tokens
        cached = self.matches.get(rid)
        if cached is None or cached[0] != num:
            index = self.indexes.get(rid)
            if index is None:
                index = self.indexes[rid] = NgramIndex(self.min_n, self.max_n)
            cached = self.matches[rid] = (num, index.match(request.token_ids))
        return cached[1]

    def commit(self, request) -> None:
        """Extends the request's index to its committed tokens, a few per step. Done every
        step rather than at the next ``context_class``, so that the work does not pile up
        while planning is paused (``engine.spec_decode.batch_pause``) and fall on one step."""
        rid = request.request_id
        index = self.indexes.get(rid)
        if index is None or index.num_indexed_ends > request.num_tokens - 1:  # new, or rolled back past it
            index = self.indexes[rid] = NgramIndex(self.min_n, self.max_n)
        index.extend(request.token_ids)
        self.matches.pop(rid, None)

    def free(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)
        self.matches.pop(request_id, None)


def build(spec, **_) -> NgramDrafter:
    return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
