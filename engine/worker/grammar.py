"""Structured outputs: a grammar per request, applied as a token mask to p and to q.

Library: xgrammar, for its next-token mask, faster than llguidance's: masks are on
the hot path (up to k + 1 per request per step for verification, k more for a model
drafter), while compilation happens once per distinct grammar, at the door, behind
an LRU cache. xgrammar also rolls a matcher back by any number of tokens, which
drafted prefixes need. Its cost: pip also installs triton, which the CPU build never
imports.

The rule. ``mask(prefix)`` is the set of tokens the grammar allows after the
committed tokens plus ``prefix``; a stop token (EOS) is in it only where the
grammar accepts. The processed distribution of a request with a grammar is its
usual processing (penalties, bias, temperature, top-k, top-p, min-p) of the logits
with the tokens outside the mask set to -inf, so p (the target) and q (a sampling
drafter) are renormalized over the mask. At verification row ``i`` (after drafts
``d_1 .. d_i``) the mask is ``mask(d_1 .. d_i)``; the drafter samples ``d_{i+1}``
from q masked by the same set, so q is the distribution the draft really came from.

Cutting drafts. ``LLMEngine`` truncates a draft chain at its first token outside
the grammar (``valid_draft_prefix``) before the target pass. This looks at the
drafted tokens, but only to drop impossible ones, and it keeps the output exact:
at a cut position ``x`` with ``p(x) = 0`` the rule would reject ``x`` for sure and
sample the token from ``normalize(max(0, p - q))``; after a cut the same row
gives the bonus token from ``p``. The two agree whenever q has no mass outside
the mask: a masked sampling drafter never drafts outside it (except after a
drafted stop token, where the request ends anyway), and a deterministic drafter's
q is one-hot at ``x``, so ``max(0, p - q) = p``. A drafter whose q were NOT
masked would make the cut inexact (tests/spec/test_grammar_distribution.py shows
that the chi-square test catches it).

The matcher of a request advances only with committed tokens (``accept``, from
``engine.core.stop.append_tokens``); masks of drafted prefixes accept the drafts,
fill, and roll back. A request ends with finish_reason "stop" when its grammar
is complete and nothing but a stop token may follow (or a stop token was taken).
"""

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch
import xgrammar as xgr

from engine.worker.sampler import unpack_bitmask
from engine.sampling_params import GuidedDecoding, InvalidParameter

CACHE_SIZE = 128  # compiled grammars kept (least recently used dropped first)


class Grammars:
    """Compiles ``GuidedDecoding`` specs for one vocabulary, with an LRU cache. Thread-safe:
    the server compiles at the door (event loop) while the engine thread makes matchers."""

    def __init__(self, info: xgr.TokenizerInfo, cache_size: int = CACHE_SIZE):
        self.vocab_size = info.vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self.cache_size = cache_size
        self.lock = threading.Lock()

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> "Grammars":
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))

    def compile(self, spec: GuidedDecoding) -> xgr.CompiledGrammar:
        """The compiled grammar; raises ``InvalidParameter`` naming ``spec.param`` and the problem."""
        key = (spec.kind, spec.value)
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        try:
            compiled = self._compile(spec)
        except Exception as e:  # noqa: BLE001 - any failure to compile is the grammar's problem
            raise InvalidParameter(spec.param, f"is not a valid {_WHAT[spec.kind]}: {_clean(e)}") from None
        with self.lock:
            self.cache[key] = compiled
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GuidedDecoding) -> xgr.CompiledGrammar:
        if spec.kind == "json":
            return self.compiler.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return self.compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            return self.compiler.compile_grammar("root ::= " + " | ".join(_ebnf_string(c) for c in choices))
        if spec.kind == "grammar":
            if is_ebnf(spec.value):
                return self.compiler.compile_grammar(spec.value)
            return self.compiler.compile_lark(spec.value)
        raise ValueError(f"unknown kind {spec.kind!r}")

    def matcher(self, spec: GuidedDecoding, stop_ids: Sequence[int]) -> "RequestGrammar":
        """A fresh matcher; ``stop_ids`` (EOS and the request's stop tokens) are allowed
        only where the grammar accepts."""
        return RequestGrammar(self.compile(spec), sorted(stop_ids), self.vocab_size)


_WHAT = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
         "choice": "list of choices", "grammar": "grammar (EBNF with 'root ::= ...', or Lark with 'start: ...')"}


def is_ebnf(grammar: str) -> bool:
    """xgrammar's EBNF defines rules with ``::=``; a grammar without one is read as Lark
    (``rule: ...``), the rule vLLM follows."""
    return re.search(r"^\s*[A-Za-z_][\w-]*\s*::=", grammar, re.M) is not None


def _clean(error: Exception) -> str:
    """xgrammar's message without its timestamp, source location and assertion text."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)


def _ebnf_string(text: str) -> str:
    """A string literal of xgrammar's EBNF: JSON's escapes, which it reads the same way."""
    return json.dumps(text, ensure_ascii=False)


class RequestGrammar:
    """One request's matcher, at the state after its committed output tokens."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: list[int], vocab_size: int):
        # No stop token at all (a vocabulary without EOS): the grammar ends the request.
        self.matcher = xgr.GrammarMatcher(
            compiled, override_stop_tokens=stop_ids or None, terminate_without_stop_token=not stop_ids
        )
        self.stop_ids = stop_ids
        self.vocab_size = vocab_size
        self.drafted: tuple[int, ...] = ()  # tokens accepted on top of the committed state

    def accept(self, token: int) -> bool:
        """Commit one output token; False when the grammar does not allow it."""
        self._to_prefix(())
        return self.matcher.accept_token(token)

    @property
    def is_done(self) -> bool:
        """A stop token was taken, or the grammar is complete and only a stop token may follow."""
        self._to_prefix(())
        if self._stop_taken():
            return True
        if not self.matcher.is_completed():
            return False
        bitmask = torch.full((1, xgr.get_bitmask_shape(1, self.vocab_size)[1]), -1, dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(bitmask)
        allowed = unpack_bitmask(bitmask, self.vocab_size)[0]
        allowed[self.stop_ids] = False
        return not bool(allowed.any())

    def valid_draft_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the grammar allows after the committed state."""
        self._to_prefix(())
        n = 0
        for t in tokens:
            if not self.matcher.accept_token(t):
                break
            n += 1
            if self._stop_taken():  # nothing may follow a stop token
                break
        self.matcher.rollback(n)
        return n

    def fill(self, bitmask: torch.Tensor, row: int, prefix: Sequence[int]) -> None:
        """Row ``row`` of an int32 bitmask: the tokens allowed after the committed state plus
        ``prefix`` (consecutive calls that extend a prefix cost one token each). A row
        after a stop token or a token outside the grammar allows everything: only a
        drafter meets one (verification rows never do: such drafts are cut), and
        nothing drafted there is kept."""
        if not self._to_prefix(tuple(prefix)) or self._stop_taken():
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def _stop_taken(self) -> bool:
        return bool(self.stop_ids) and self.matcher.is_terminated()

    def _to_prefix(self, prefix: tuple[int, ...]) -> bool:
        """Roll back / accept so that the matcher sits at committed + ``prefix``; False
        (the matcher then at the longest allowed part of it) when the grammar does not
        allow all of ``prefix``."""
        common = 0
        while common < min(len(prefix), len(self.drafted)) and prefix[common] == self.drafted[common]:
            common += 1
        if len(self.drafted) > common:
            self.matcher.rollback(len(self.drafted) - common)
        self.drafted = prefix[:common]
        for t in prefix[common:]:
            if self._stop_taken() or not self.matcher.accept_token(t):
                return False
            self.drafted += (t,)
        return True
