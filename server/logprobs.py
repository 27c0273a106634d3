"""Engine ``TokenLogprob`` lists in OpenAI's two logprobs shapes, and prompt
logprobs in the legacy shape (``echo``) and in vLLM's ``prompt_logprobs`` shape.

Token strings are the token decoded alone (a piece of a multi-byte character
decodes to U+FFFD; its ``bytes`` in the chat shape are those of that string).
Logprobs below ``LOGPROB_FLOOR`` (including -inf, which JSON cannot carry) are
clamped to it, as vLLM does.
"""

import dataclasses
from functools import lru_cache

from api.protocol import ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs
from engine.outputs import TokenLogprob

LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


class TokenDecoder:
    """token id -> its text alone, cached (the vocabulary is small and fixed)."""

    def __init__(self, tokenizer):
        self._decode = lru_cache(maxsize=65536)(lambda t: tokenizer.decode([t]))

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)


def completion_logprobs(
    lps: list[TokenLogprob], decode: TokenDecoder, text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy shape for ``lps``, whose first token starts at ``text_offset`` of the
    choice's text; returns it and the offset after the last token. ``top_logprobs``
    always holds the sampled token too (vLLM's convention)."""
    out = CompletionLogprobs()
    for lp in lps:
        text = decode(lp.token_id)
        top = {decode(t): _lp(v) for t, v in lp.top}
        top.setdefault(text, _lp(lp.logprob))
        out.tokens.append(text)
        out.token_logprobs.append(_lp(lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(text)
    return out, text_offset


def chat_logprobs(lps: list[TokenLogprob], decode: TokenDecoder) -> list[ChatTokenLogprob]:
    """The chat shape: one entry per token with its ``top_logprobs`` (empty when 0 were asked)."""
    out = []
    for lp in lps:
        text = decode(lp.token_id)
        top = [ChatTopLogprob(token=(s := decode(t)), logprob=_lp(v), bytes=list(s.encode())) for t, v in lp.top]
        out.append(ChatTokenLogprob(token=text, logprob=_lp(lp.logprob), bytes=list(text.encode()), top_logprobs=top))
    return out


def echo_logprobs(
    prompt_ids: list[int], lps: list[TokenLogprob], top_n: int, decode: TokenDecoder
) -> tuple[CompletionLogprobs, int]:
    """The legacy shape of an echoed prompt: the first token with ``null`` logprob and
    top logprobs (nothing predicts it), then ``lps`` (prompt tokens 1..) cut to the top
    ``top_n``; returns it and the text offset after the prompt."""
    first = decode(prompt_ids[0])
    cut = [dataclasses.replace(lp, top=lp.top[:top_n]) for lp in lps]
    out, offset = completion_logprobs(cut, decode, len(first))
    out.tokens.insert(0, first)
    out.token_logprobs.insert(0, None)
    out.top_logprobs.insert(0, None)
    out.text_offset.insert(0, 0)
    return out, offset


def vllm_prompt_logprobs(lps: list[TokenLogprob], top_n: int, decode: TokenDecoder) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token a dict
    token id -> {logprob, rank, decoded_token} holding the prompt token and the top ``top_n``."""
    out: PromptLogprobs = [None]
    for lp in lps:
        entry = {lp.token_id: PromptLogprob(logprob=_lp(lp.logprob), rank=lp.rank, decoded_token=decode(lp.token_id))}
        for rank, (t, v) in enumerate(lp.top[:top_n], 1):
            entry.setdefault(t, PromptLogprob(logprob=_lp(v), rank=rank, decoded_token=decode(t)))
        out.append(entry)
    return out
