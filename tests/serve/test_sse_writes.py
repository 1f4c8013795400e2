"""A stream goes out one write per hand-over of the engine: what the engine hands over
together is read together and written together, nothing waits to be joined, and a response
closes its streams however it ends."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.requests import ClientDisconnect
from tiny_server import HELLO_Q, MODEL, engine_for

from astrai.infer.events import Events, StreamEvent
from astrai.infer.sampling import SamplingParams
from astrai.serve.app import make_app
from astrai.serve.background import serve_in_background
from astrai.serve.engine_requests import EngineRequest
from astrai.serve.metrics import Metrics
from astrai.serve.sse import EventStream, writes
from astrai.serve.streams import Choices, open_choices


def event(text: str, finish: str | None = None, error: str | None = None) -> StreamEvent:
    return StreamEvent("r", text, [1] * len(text), finish_reason=finish, error=error)


class Scripted:
    """Choices that hand over a scripted list of hand-overs."""

    def __init__(self, handovers: list[list[StreamEvent]]):
        self.handovers = iter(handovers)

    def __aiter__(self):
        return self

    async def __anext__(self):
        for handover in self.handovers:
            return [(0, e) for e in handover]
        raise StopAsyncIteration

    async def aclose(self) -> None:
        pass


class Texts:
    """A writer of each event's text, between [ and ]."""

    def head(self) -> list[bytes]:
        return [b"["]

    def chunks(self, i: int, event) -> list[bytes]:
        return [event.text.encode()] if event.text else []

    def tail(self) -> list[bytes]:
        return [b"]"]

    def failure(self, reason: str | None) -> bytes:
        return f"!{reason}".encode()


def body(handovers: list[list[StreamEvent]]) -> list[bytes]:
    async def run():
        return [w async for w in writes(Scripted(handovers), Texts())]

    return asyncio.run(run())


def test_one_write_per_handover():
    handovers = [[event("a")], [event("b"), event("c"), event("")], [event("d", "stop")]]
    assert body(handovers) == [b"[", b"a", b"bc", b"d", b"]"]


def test_a_failure_ends_the_body_after_what_came_before_it():
    handovers = [[event("a")], [event("b"), event("", "error", "boom"), event("c")]]
    assert body(handovers) == [b"[", b"a", b"b!boom"]


def test_events_at_hand_until_read_and_after_the_end():
    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        events = Events(queue, lambda: None)
        assert not events.at_hand()
        queue.put_nowait(event("a"))
        assert events.at_hand()
        await anext(events)
        assert not events.at_hand()
        queue.put_nowait(event("", "stop"))
        await anext(events)
        assert events.at_hand()  # the next read ends at once

    asyncio.run(run())


def handovers_read(arrivals: list[list[tuple[int, StreamEvent]]], n: int) -> list:
    """The hand-over Choices reads from n streams after each arrival of events (an arrival's
    events are put in their streams together, the next once the last was read)."""

    async def run():
        queues = [asyncio.Queue() for _ in range(n)]
        streams = {i: Events(q, lambda: None) for i, q in enumerate(queues)}
        choices = Choices("r", streams, {}, Metrics(), 0.0)
        read = []
        for arrival in arrivals:
            for i, e in arrival:
                queues[i].put_nowait(e)
            read.append([(i, e.text) for i, e in await anext(choices)])
        return read

    return asyncio.run(run())


def test_a_stream_reads_what_arrived_together_as_one_handover():
    queued = [[(0, event("a"))], [(0, event("b")), (0, event("c"))], [(0, event("d", "stop"))]]
    assert handovers_read(queued, 1) == [[(0, "a")], [(0, "b"), (0, "c")], [(0, "d")]]


def test_choices_read_what_arrived_together_as_one_handover():
    queued = [
        [(0, event("a")), (1, event("x"))],
        [(1, event("y")), (1, event("z", "stop")), (0, event("b"))],
        [(0, event("c", "stop"))],
    ]
    read = handovers_read(queued, 2)
    assert read == [[(0, "a"), (1, "x")], [(0, "b"), (1, "y"), (1, "z")], [(0, "c")]]


def test_tokens_handed_over_together_are_read_together(tiny):
    """With hand-overs held for a minute, the first token goes out at once and every event
    after it comes in one hand-over at the end."""
    prompt = tiny[2].encode("Say hello.")

    async def run(engine):
        request = EngineRequest(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        choices = await open_choices(engine, "r", [request], Metrics())
        sizes = [len(handover) async for handover in choices]
        await choices.aclose()
        return sizes

    with engine_for(tiny, stream_interval_ms=60_000) as engine:
        sizes = asyncio.run(run(engine))
    # the first token alone, unless the loop was too busy to read it before the rest came
    assert sizes in ([1, 7], [8])


def test_a_stream_is_written_once_per_handover(tiny):
    """Over HTTP, with hand-overs held for a minute, four writes: the role, the first token,
    the other seven with the finish, and [DONE]."""
    with engine_for(tiny, stream_interval_ms=60_000) as engine:
        app = make_app(engine, MODEL)
        written = []

        async def counting(scope, receive, send):
            async def counted(message):
                if message["type"] == "http.response.body" and message.get("body"):
                    written.append(message["body"])
                await send(message)

            await app(scope, receive, counted)

        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": HELLO_Q}],
            "max_tokens": 8,
            "ignore_eos": True,
            "stream": True,
        }
        with (
            serve_in_background(counting) as url,
            httpx.stream("POST", url + "/v1/chat/completions", json=body) as response,
        ):
            text = b"".join(response.iter_bytes())
    # chunks: the role, a delta per token with text, the finish, [DONE]
    assert text.endswith(b"data: [DONE]\n\n") and text.count(b"data: ") >= 6
    assert len(written) in (3, 4)  # 3: the first token came with the rest (a busy loop)


def test_event_stream_closes_its_streams_when_the_client_is_gone():
    closed = []

    class Choices:
        request_id = "r"

        def __aiter__(self):
            return self

        async def __anext__(self):
            return [(0, event("a"))]

        async def aclose(self) -> None:
            closed.append(True)

    async def send(message):
        if message["type"] == "http.response.body":
            raise OSError("the client went away")

    async def receive():
        return {"type": "http.disconnect"}

    response = EventStream(Choices(), Texts())
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(ClientDisconnect):
        asyncio.run(response(scope, receive, send))
    assert closed == [True]
