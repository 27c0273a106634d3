"""Appending sampled tokens to a request and applying its stop conditions.

Tokens are appended one at a time, so a stop inside a run of several accepted
tokens (speculative decoding) drops everything after it. A request with a
grammar advances its matcher with each committed token and stops ("stop") once
the grammar is done (see ``engine.worker.grammar``).
"""

from engine.outputs import TokenLogprob
from engine.core.request import Request


def append_tokens(
    request: Request, token_ids: list[int], max_model_len: int, logprobs: list[TokenLogprob] | None = None
) -> int:
    """Append tokens until one of them finishes the request; returns how many were kept."""
    for i, tok in enumerate(token_ids):
        request.token_ids.append(tok)
        if request.logprobs is not None and logprobs is not None:
            request.logprobs.append(logprobs[i])
        if request.detok is not None:
            _append_text(request, request.detok.decode_next(request.token_ids))
        if request.is_finished:  # a stop string ended it
            return i + 1
        reason = _token_stop(request, tok, max_model_len)
        if reason:
            request.finish(reason, f"token {tok} is outside the request's grammar" if reason == "error" else None)
            return i + 1
    return len(token_ids)


def _token_stop(request: Request, tok: int, max_model_len: int) -> str | None:
    if tok in request.stop_ids:
        return "stop"
    if request.grammar is not None:
        if not request.grammar.accept(tok):  # the masks make this impossible; never go past it
            return "error"
        if request.grammar.is_done:
            return "stop"
    if request.num_output_tokens >= request.params.max_tokens or request.num_tokens >= max_model_len:
        return "length"
    return None


def _append_text(request: Request, delta: str) -> None:
    """Add decoded text; on a stop string, truncate the text and finish."""
    if not delta:
        return
    stops = request.params.stop
    if not stops:
        request.output_text += delta
        return
    start = max(0, len(request.output_text) - max(len(s) for s in stops) + 1)
    text = request.output_text + delta
    hits = [(i, s) for s in stops if (i := text.find(s, start)) >= 0]
    if not hits:
        request.output_text = text
        return
    i, s = min(hits)
    request.output_text = text[: i + len(s)] if request.params.include_stop_str_in_output else text[:i]
    request.finish("stop")


def holdback(request: Request) -> int:
    """Characters of the text to hold back while streaming: a stop string may be forming."""
    if not request.params.stop or request.is_finished:
        return 0
    return max(len(s) for s in request.params.stop) - 1
