"""Many concurrent streaming clients, both APIs at once: all finish, batched, no pages left."""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest
from tiny_server import MODEL, engine_for, serving, wait_until_idle

CLIENTS = 64
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny):
    with engine_for(tiny, max_batch=64) as engine, serving(engine) as url:
        yield url, engine


async def openai_stream(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"client {i}"}],
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    text, finish = "", None
    async for chunk in stream:
        text += chunk.choices[0].delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    return text, finish


async def anthropic_stream(client: anthropic.AsyncAnthropic, i: int) -> tuple[str, str | None]:
    async with client.messages.stream(
        model=MODEL, max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": f"client {i}"}]
    ) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    return text, final.stop_reason


async def many_clients(url: str):
    async with (
        openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as oa,
        anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as an,
    ):
        streams = [
            openai_stream(oa, i) if i % 2 else anthropic_stream(an, i) for i in range(CLIENTS)
        ]
        return await asyncio.gather(*streams)


def test_concurrent_streams_complete_and_free_their_pages(server):
    url, engine = server
    before = engine.stats()
    results = asyncio.run(many_clients(url))
    assert len(results) == CLIENTS
    finishes = {finish for _, finish in results}
    assert finishes <= {"stop", "length", "end_turn", "max_tokens"}
    stats = wait_until_idle(engine)
    assert stats.running == 0 and stats.waiting == 0 and stats.pages_used == 0
    assert stats.requests_finished - before.requests_finished == CLIENTS
    tokens = stats.completion_tokens - before.completion_tokens
    steps = stats.steps - before.steps
    assert steps < tokens  # continuous batching: many requests advance in one step
