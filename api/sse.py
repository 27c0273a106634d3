"""Server-sent events: one ``data: {json}`` line per chunk, then ``data: [DONE]``."""

import json

from pydantic import BaseModel

from api.errors import APIError

DONE = "data: [DONE]\n\n"


def sse_chunk(chunk: BaseModel, include_usage: bool) -> str:
    """A stream chunk; ``usage`` appears (null until the last chunk) only when the
    client asked for it with ``stream_options.include_usage``."""
    exclude = None if include_usage else {"usage"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


def sse_error(error: APIError) -> str:
    """An error in mid-stream: an event with OpenAI's error body; the stream then ends with [DONE]."""
    return f"data: {json.dumps(error.body())}\n\n"
