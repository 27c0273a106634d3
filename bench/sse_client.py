"""A lean streaming client for the benchmarks that share the server's two cores.

httpx spends a fraction of a millisecond of CPU on each server-sent event, and on a
2-core machine that time is taken from the server. This client reads the HTTP/1.1
response with asyncio streams and decodes each event with ``json.loads``: the same
information, a fraction of the CPU. Every event is still read and parsed.

    result = await stream_chat(url, body)   # body: a /v1/chat/completions request, "stream": True
    result.tokens, result.event_times, result.text
"""

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit


@dataclass
class StreamResult:
    tokens: int = 0  # completion_tokens of the usage block (0 when the server sent none)
    event_times: list[float] = field(default_factory=list)  # perf_counter of each event with new text
    text: str = ""
    start: float = 0.0
    end: float = 0.0


class StreamError(RuntimeError):
    pass


async def stream_chat(url: str, body: dict, path: str = "/v1/chat/completions") -> StreamResult:
    """POSTs ``body`` (a streamed request) and reads its events to ``[DONE]``."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    res = StreamResult(start=time.perf_counter())
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode() + payload
        )
        await writer.drain()
        status = await reader.readline()
        headers = (await reader.readuntil(b"\r\n\r\n")).lower()
        if b" 200 " not in status:
            raise StreamError(f"{status.decode().strip()}: {(await reader.read()).decode(errors='replace')[:300]}")
        chunked = b"transfer-encoding: chunked" in headers
        pieces, pending = [], b""
        async for data in _body(reader, chunked):
            pending += data
            *events, pending = pending.split(b"\n\n")
            for event in events:
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                chunk = json.loads(event[6:])
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                text = "".join(c.get("delta", {}).get("content") or "" for c in chunk.get("choices", []))
                if text:
                    res.event_times.append(time.perf_counter())
                    pieces.append(text)
        res.text = "".join(pieces)
    finally:
        writer.close()
    res.end = time.perf_counter()
    return res


async def _body(reader: asyncio.StreamReader, chunked: bool):
    """The response body as it arrives: de-chunked, or read to the end of the connection."""
    if not chunked:
        while data := await reader.read(65536):
            yield data
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF


def chat_body(prompt: str, max_tokens: int, **extra) -> dict:
    """A greedy streamed chat request with the usage block."""
    return {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
