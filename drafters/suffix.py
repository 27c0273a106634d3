"""Suffix decoding (SuffixDecoding, Oliaro et al. 2024; vLLM's ``"method": "suffix"``): token
trees drawn from the request's own prompt and output and from recent requests' outputs.

Two indexes (``drafters/suffix_tree.c``, compiled at first use): a request's own tokens
(prompt, then output), and a global one over the outputs of the running requests and of
the last ``suffix_decoding_max_cached_requests`` finished ones (FIFO; 0: none). Both are
appended at every step's commit, so a running request already helps the others. Per step
the last ``n`` tokens of the context are looked up for every pattern length ``n`` that
occurs; the continuations after their occurrences are counted into a prefix tree, each
node scored by its frequency-estimated probability (its parent's times count(node) /
count(parent)); the nodes are taken best first, none under
``suffix_decoding_min_token_prob``, at most ``n * suffix_decoding_max_spec_factor`` of
them, within the slot's shape (a chain, or the policy's tree template), and the pattern
length whose tree has the most expected accepted tokens wins. The draft branches where
the continuations do.

Exactness: the draft is a deterministic function of the committed tokens and of the
indexes before the step, so q is one-hot at each proposed token (``deterministic``, as
prompt lookup); the frequency scores only rank and prune, they are not q. Verification
then follows the recursive rule for one-hot drafts (``engine.spec_decode.tree_sampler``),
which leaves the target's distribution unchanged.

Seeded requests draft from their own index only, so that their drafts, and so their
outputs, do not depend on other traffic; their outputs still join the global index.
"""

import ctypes
import functools
from collections import deque
from pathlib import Path

from engine.layers.cpu_kernels import compile_library, compiler
from engine.utils import tree
from engine.spec_decode.drafter import Draft, Drafter, DraftSlot

SOURCE = Path(__file__).with_name("suffix_tree.c")
MAX_LIVE = 4096  # running requests indexed at once (more decode without drafts)
MAX_NODES = 256  # the C side's most nodes per draft
MAX_WIDTHS = 64


def pattern_lengths(max_depth: int) -> list[int]:
    """The pattern lengths indexed: 1 to 8, then 12, 16, 20, ... below ``max_depth`` (a
    pattern leaves room for at least one drafted token within the tree depth)."""
    return [n for n in [*range(1, 9), *range(12, 64, 4)] if n < max_depth]


def glob_log2(max_cached: int) -> int:
    """Global-table buckets (72 bytes each): about 32 per cached request, 2^12 to 2^19."""
    return min(19, max(12, (32 * max_cached - 1).bit_length())) if max_cached else 0


@functools.lru_cache(maxsize=256)
def _widths(shape: tuple[int, ...] | None, k: int):
    """``tree.max_widths`` of a template (one child per depth for a chain of ``k``), as a C
    array and its length: the policy reuses a few templates, so each is computed once."""
    widths = tree.max_widths(shape[:k])[:MAX_WIDTHS] if shape is not None else [1] * min(k, MAX_WIDTHS)
    return (ctypes.c_int32 * len(widths))(*widths), len(widths)


@functools.cache
def _library():
    cc = compiler()
    if cc is None:
        raise ValueError('the "suffix" method needs a C compiler (cc or gcc) to build its index')
    lib = ctypes.CDLL(str(compile_library("suffix_tree", [SOURCE], cc, ("-O2", "-shared", "-fPIC"))))
    i32, u32, p = ctypes.c_int32, ctypes.c_uint32, ctypes.c_void_p
    sigs = {
        "sp_create": ([i32, i32, p, i32, i32], p),
        "sp_destroy": ([p], None),
        "sp_memory": ([p], ctypes.c_int64),
        "sp_open": ([p, u32, i32, i32], i32),
        "sp_append": ([p, u32, p, i32], i32),
        "sp_truncate": ([p, u32, i32], i32),
        "sp_close": ([p, u32, i32, i32], None),
        "sp_speculate": ([p, u32, i32, i32, p, i32, ctypes.c_float, ctypes.c_float, p, p, p, p], i32),
        "sp_match": ([p, u32, i32], i32),
    }
    for name, (args, res) in sigs.items():
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, res
    return lib


class SuffixIndex:
    """The C store: sequences by id, the own and global tables. Ids are ``gen * nslots + slot``."""

    def __init__(self, max_depth: int, max_cached: int):
        self.lib = _library()
        self.lens = pattern_lengths(max_depth)
        self.max_cached = max_cached
        self.nslots = MAX_LIVE + max_cached
        lens = (ctypes.c_int32 * len(self.lens))(*self.lens)
        self.handle = self.lib.sp_create(self.nslots, glob_log2(max_cached), lens, len(self.lens), max_depth)
        if not self.handle:
            raise MemoryError("suffix decoding: could not allocate its index")
        self.free_slots = deque(range(self.nslots))
        self.gen = [0] * self.nslots
        self.finished: deque[int] = deque()  # closed sequences kept for the global table, oldest first
        self.num_live = 0
        self.keep_before = max_depth  # prompt tokens kept before a finished output (its first patterns)
        self._tok = (ctypes.c_int32 * MAX_NODES)()
        self._par = (ctypes.c_int32 * MAX_NODES)()
        self._prob = (ctypes.c_float * MAX_NODES)()
        self._match = ctypes.c_int32()

    def __del__(self):
        if getattr(self, "handle", None):
            self.lib.sp_destroy(self.handle)

    def open(self, out_start: int, shared: bool) -> int | None:
        """A new sequence (None: too many running); ``shared``: its output joins the global table."""
        if self.num_live >= MAX_LIVE:
            return None
        if not self.free_slots:
            self._evict()
        slot = self.free_slots.popleft()
        self.gen[slot] = self.gen[slot] % ((1 << 32) // self.nslots - 2) + 1  # ids stay in 32 bits, never 0
        sid = self.gen[slot] * self.nslots + slot
        self.lib.sp_open(self.handle, sid, out_start, int(shared))
        self.num_live += 1
        return sid

    def append(self, sid: int, tokens: list[int]) -> None:
        if tokens:
            self.lib.sp_append(self.handle, sid, (ctypes.c_int32 * len(tokens))(*tokens), len(tokens))

    def truncate(self, sid: int, length: int) -> None:
        self.lib.sp_truncate(self.handle, sid, length)

    def close(self, sid: int) -> None:
        """The request ended: its output stays for the global table (FIFO), or goes."""
        self.num_live -= 1
        keep = self.max_cached > 0
        self.lib.sp_close(self.handle, sid, int(keep), self.keep_before)
        if not keep:
            self.free_slots.append(sid % self.nslots)
            return
        self.finished.append(sid)
        while len(self.finished) > self.max_cached:
            self._evict()

    def _evict(self) -> None:
        sid = self.finished.popleft()
        self.lib.sp_close(self.handle, sid, 0, 0)
        self.free_slots.append(sid % self.nslots)

    def match(self, sid: int, use_glob: bool) -> int:
        return self.lib.sp_match(self.handle, sid, int(use_glob))

    def speculate(self, sid: int, use_glob: bool, max_nodes: int, widths, factor: float, min_prob: float):
        """``(token_ids, parents, probs, pattern length)`` of the draft (see the C header);
        ``widths``: per depth, the most children of a node (a list, or ``_widths``' pair)."""
        if isinstance(widths, list):
            widths = ((ctypes.c_int32 * len(widths))(*widths[:MAX_WIDTHS]), min(len(widths), MAX_WIDTHS))
        n = self.lib.sp_speculate(self.handle, sid, int(use_glob), min(max_nodes, MAX_NODES), widths[0], widths[1],
                                  factor, min_prob, self._tok, self._par, self._prob, ctypes.byref(self._match))
        return list(self._tok[:n]), tuple(self._par[:n]), list(self._prob[:n]), self._match.value

    def memory_bytes(self) -> int:
        return int(self.lib.sp_memory(self.handle))


class SuffixDrafter(Drafter):
    deterministic = True  # q is one-hot at each proposed token (module docstring)
    cost_per_token = 0.0

    def __init__(self, max_depth: int = 24, max_cached: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1):
        self.index = SuffixIndex(max_depth, max_cached)
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.seqs: dict[str, list] = {}  # request id -> [sequence id, tokens appended, seeded]

    def _sync(self, request) -> list | None:
        """The request's sequence, with its committed tokens appended (opened at first sight)."""
        rid = request.request_id
        st = self.seqs.get(rid)
        if st is None:
            seeded = request.params.seed is not None
            sid = self.index.open(request.num_prompt_tokens, shared=True)
            if sid is None:
                return None
            st = self.seqs[rid] = [sid, 0, seeded]
        tokens = request.token_ids
        if len(tokens) < st[1]:  # rolled back: cut, then append what differs
            self.index.truncate(st[0], len(tokens))
            st[1] = len(tokens)
        if len(tokens) > st[1]:
            self.index.append(st[0], tokens[st[1]:])
            st[1] = len(tokens)
        return st

    def context_class(self, request) -> int | None:
        """The longest pattern length that occurs (longer matches predict better); None: no match."""
        st = self._sync(request)
        if st is None:
            return None
        n = self.index.match(st[0], use_glob=not st[2])
        return n or None

    def propose(self, slots: list[DraftSlot]) -> dict[str, Draft]:
        out = {}
        for slot in slots:
            st = self._sync(slot.request)
            if st is None:
                continue
            k = slot.num_draft_tokens
            token_ids, parents, _, _ = self.index.speculate(
                st[0], not st[2], k, _widths(slot.shape, k), self.max_spec_factor, self.min_token_prob)
            if token_ids:
                out[slot.request.request_id] = Draft(token_ids, None, None if tree.is_chain(parents) else parents)
        return out

    def commit(self, request) -> None:
        """Appends the step's committed tokens: every step, so the global table is current
        and no work piles up for a later step."""
        self._sync(request)

    def free(self, request_id: str) -> None:
        st = self.seqs.pop(request_id, None)
        if st is not None:
            self.index.close(st[0])


def from_config(spec) -> SuffixDrafter:
    return SuffixDrafter(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                         spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob)


def build(spec, **_) -> SuffixDrafter:
    return from_config(spec)
