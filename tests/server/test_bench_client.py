"""The benchmarks' lean streaming client (bench.sse_client) reads what the OpenAI client reads."""

import asyncio
import json

import pytest

from bench.peers import server_command
from bench.sse_client import StreamError, chat_body, stream_chat
from tests.server.conftest import MODEL


def test_stream_matches_the_openai_client(server, client):
    prompt = "Name three colours."
    body = chat_body(prompt, 12, ignore_eos=True)
    lean = asyncio.run(stream_chat(server.url, body))
    ref = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert lean.tokens == ref.usage.completion_tokens == 12
    assert lean.text == ref.choices[0].message.content
    assert 1 <= len(lean.event_times) <= 12
    assert lean.start <= lean.event_times[0] <= lean.event_times[-1] <= lean.end


def test_concurrent_streams(server):
    async def run():
        return await asyncio.gather(*(stream_chat(server.url, chat_body(f"Count to {i}.", 6, ignore_eos=True))
                                      for i in range(4)))

    assert [r.tokens for r in asyncio.run(run())] == [6] * 4


def test_an_error_status_is_raised_with_its_body(server):
    with pytest.raises(StreamError, match="400.*max_tokens"):
        asyncio.run(stream_chat(server.url, chat_body("Hi", -1)))


def test_peer_servers_take_suffix_decoding(tmp_path):
    cmd, _, _ = server_command("specserve-float32-suffix", 8000, tmp_path)
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {"method": "suffix"}
    assert cmd[cmd.index("--quantization") + 1] == "none"
    assert server_command("vllm-suffix", 8000, tmp_path) is None  # no vLLM installed in tmp_path
