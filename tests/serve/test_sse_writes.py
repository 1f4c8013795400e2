"""Server-sent events at hand together go out in one write, nothing waits to be joined, and a
response closes its streams however it ends."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import ClientDisconnect
from tiny_server import engine_for

from astrai.infer.events import Events
from astrai.infer.sampling import SamplingParams
from astrai.serve.engine_requests import EngineRequest
from astrai.serve.metrics import Metrics
from astrai.serve.sse import EventStream, _joined
from astrai.serve.streams import open_choices


class Scripted:
    """Choices whose `at_hand` answers from a script, one answer per chunk read."""

    def __init__(self, answers: list[bool]):
        self.answers = iter(answers)

    def at_hand(self) -> bool:
        return next(self.answers)


async def writes(chunks: list[bytes], answers: list[bool]) -> list[bytes]:
    async def body():
        for chunk in chunks:
            yield chunk

    return [w async for w in _joined(body(), Scripted(answers))]


def test_chunks_at_hand_are_joined_and_the_rest_sent_at_once():
    chunks = [b"a", b"b", b"c", b"d", b"e"]
    assert asyncio.run(writes(chunks, [True, True, False, False, True])) == [b"abc", b"d", b"e"]
    assert asyncio.run(writes(chunks, [False] * 5)) == chunks
    assert asyncio.run(writes(chunks, [True] * 5)) == [b"abcde"]  # the end flushes


def test_events_at_hand_until_read_and_after_the_end():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        events = Events(queue, lambda: None)
        assert not events.at_hand()
        queue.put_nowait(type("E", (), {"finish_reason": None})())
        assert events.at_hand()
        await anext(events)
        assert not events.at_hand()
        queue.put_nowait(type("E", (), {"finish_reason": "stop"})())
        await anext(events)
        assert events.at_hand()  # the next read ends at once

    asyncio.run(run())


def test_tokens_handed_over_together_are_at_hand_together(tiny):
    """With hand-overs held for a minute, every event after the first token comes in one
    hand-over at the end: the stream reads each of them without waiting, so one write carries
    them all."""
    prompt = tiny[2].encode("Say hello.")

    async def run(engine):
        request = EngineRequest(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        choices = await open_choices(engine, [request], Metrics())
        at_hand = []
        async for _, event in choices:
            at_hand.append(choices.at_hand())
            if event.finish_reason is not None:
                break
        await choices.aclose()
        return at_hand

    with engine_for(tiny, stream_interval_ms=60_000) as engine:
        at_hand = asyncio.run(run(engine))
    assert len(at_hand) == 8 and all(at_hand[1:])


def test_event_stream_closes_its_streams_when_the_client_is_gone():
    closed = []

    class Choices:
        def at_hand(self) -> bool:
            return False

        async def aclose(self) -> None:
            closed.append(True)

    async def body():
        yield b"data: 1\n\n"
        yield b"data: 2\n\n"

    async def send(message):
        if message["type"] == "http.response.body":
            raise OSError("the client went away")

    async def receive():
        return {"type": "http.disconnect"}

    response = EventStream(body(), Choices())
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(ClientDisconnect):
        asyncio.run(response(scope, receive, send))
    assert closed == [True]
