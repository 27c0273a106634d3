"""How a ``Generation`` becomes a response: collected whole, or as server-sent events.

Both close the generation however they end. A stream that fails after its
first byte cannot change its status any more, so the failure is sent as an
error event (OpenAI's error body) followed by ``data: [DONE]``; a client that
went away gets nothing more.
"""

import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from api.errors import APIError
from api.sse import DONE, sse_error
from engine.outputs import RequestOutput, TokenLogprob
from server.serving import ClientGone, Generation

log = logging.getLogger(__name__)

CLIENT_CLOSED = 499  # nginx's "client closed request": the status of a response nobody reads


@dataclass
class ChoiceResult:
    """One choice of a finished generation."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 1.., when the request asked
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    spec: dict = field(default_factory=dict)  # speculation summary of the finished choice


async def collect(gen: Generation) -> list[ChoiceResult] | None:
    """Every choice's whole output; None when the client went away. Raises APIError."""
    results = [ChoiceResult() for _ in gen.choices]
    try:
        async for i, out in gen.stream():
            r = results[i]
            r.text += out.new_text
            r.logprobs.extend(out.logprobs or ())
            if out.prompt_logprobs is not None:
                r.prompt_logprobs = out.prompt_logprobs
            r.num_prompt_tokens = out.num_prompt_tokens
            r.num_output_tokens = out.num_output_tokens
            if out.finished:
                r.finish_reason = out.finish_reason
                r.spec = out.spec
    except ClientGone:
        return None
    finally:
        gen.close()
    return results


def client_closed() -> Response:
    return Response(status_code=CLIENT_CLOSED)


class View(Protocol):
    """How one request's engine deltas become OpenAI objects (a ``_View`` of
    serving_completion or serving_chat)."""

    def render(self, index: int, out: RequestOutput) -> Iterable[str]:
        """The SSE events of one delta of choice ``index``."""

    def tail(self) -> Iterable[str]:
        """The SSE events after the last delta (usage)."""

    def response(self, results: list[ChoiceResult]) -> BaseModel:
        """The whole response body of the finished choices."""


async def respond(gen: Generation, view: View, stream: bool) -> Response:
    """The response to a submitted generation: its events when ``stream``, else the
    whole body once every choice ended (499 when the client went away first)."""
    if stream:
        return event_stream(gen, view.render, view.tail)
    results = await collect(gen)
    return client_closed() if results is None else JSONResponse(view.response(results).model_dump())


def event_stream(
    gen: Generation, render: Callable[[int, RequestOutput], Iterable[str]], tail: Callable[[], Iterable[str]]
) -> StreamingResponse:
    """SSE of ``gen``: ``render`` gives the events of one delta, ``tail`` those after the last."""
    return StreamingResponse(_events(gen, render, tail), media_type="text/event-stream")


async def _events(gen: Generation, render, tail) -> AsyncIterator[str]:
    try:
        async for i, out in gen.stream():
            for event in render(i, out):
                yield event
        for event in tail():
            yield event
    except ClientGone:
        return
    except APIError as e:
        yield sse_error(e)
    except Exception:  # mid-stream: report it as an event, never drop the connection
        log.exception("stream failed")
        yield sse_error(APIError(500, "internal server error", code="internal_error"))
    finally:
        gen.close()
    yield DONE
