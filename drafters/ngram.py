"""Prompt lookup (n-gram) drafting over the prompt and the output so far.

Rule (Saxena 2023): take the last ``n`` tokens, the suffix; find its most recent
earlier occurrence, one that starts before the suffix itself; propose the up to
``k`` tokens that followed it. Back off to ``n - 1`` ... ``min_n`` when the
suffix never occurred. Example with n = 3, k = 2::

    a b c X a b c Y a b c      suffix "a b c"; last earlier start: index 4
            ^^^^^ followed by "Y a"  -> propose [Y, a]

Each request keeps an index from every n-gram (min_n <= n <= max_n) to its
most recent start, extended incrementally as tokens commit, so a step costs
O(k + max_n) per request, not O(context).
"""

from drafters.base import Draft, Drafter, DraftSlot, register


class NgramIndex:
    """Most recent start of every n-gram of a token list, for n in [min_n, max_n].

    Only n-grams that end before the last token are indexed, so a lookup of the
    current suffix never finds the suffix itself.
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.last_start: dict[tuple[int, ...], int] = {}
        self.num_indexed_ends = 0  # n-grams ending at positions < this are indexed

    def extend(self, tokens: list[int]) -> None:
        for end in range(self.num_indexed_ends, len(tokens) - 1):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self.last_start[tuple(tokens[end - n + 1 : end + 1])] = end - n + 1
        self.num_indexed_ends = max(self.num_indexed_ends, len(tokens) - 1)

    def propose(self, tokens: list[int], k: int) -> list[int]:
        self.extend(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = self.last_start.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []


def ngram_draft(context: list, n: int, k: int) -> list:
    """The reference rule on a plain list (any hashable tokens), backing off to 1."""
    return NgramIndex(1, n).propose(list(context), k)


class NgramDrafter(Drafter):
    deterministic = True
    cost_per_token = 0.0

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.indexes: dict[str, NgramIndex] = {}

    def propose(self, slots: list[DraftSlot]) -> dict[str, Draft]:
        out = {}
        for slot in slots:
            rid = slot.request.request_id
            index = self.indexes.get(rid)
            if index is None:
                index = self.indexes[rid] = NgramIndex(self.min_n, self.max_n)
            tokens = index.propose(slot.request.token_ids, slot.num_tokens)
            if tokens:
                out[rid] = Draft(tokens)
        return out

    def commit(self, request) -> None:
        index = self.indexes.get(request.request_id)
        if index is not None and index.num_indexed_ends > request.num_tokens - 1:
            self.indexes.pop(request.request_id)  # tokens were rolled back past the index: rebuild

    def free(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)


@register("ngram")
def _build(spec, **_) -> NgramDrafter:
    return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
