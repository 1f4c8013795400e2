"""Server-Sent Events, framed as the official OpenAI and Anthropic clients parse them, written
one hand-over of the engine at a time."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec
from starlette.responses import StreamingResponse

from astrai.serve.bodies import id_headers

_encode = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"


def data(obj) -> bytes:
    """OpenAI: one `data:` line per event, the stream ends with `data: [DONE]`."""
    return b"data: " + _encode(obj) + b"\n\n"


def named(name: str, obj) -> bytes:
    """Anthropic: every event names its type in an `event:` line."""
    return b"event: " + name.encode() + b"\ndata: " + _encode(obj) + b"\n\n"


class Writer(Protocol):
    """What an API makes of a stream: its opening chunks, the chunks of each engine event
    (choice index, event), its closing chunks, and the chunk of a failure mid-stream."""

    def head(self) -> list[bytes]: ...

    def chunks(self, i: int, event: Any) -> list[bytes]: ...

    def tail(self) -> list[bytes]: ...

    def failure(self, reason: str | None) -> bytes: ...


async def writes(choices, writer: Writer) -> AsyncIterator[bytes]:
    """The body of an event stream, one write per hand-over of the engine (see
        docs/serving.md, Streams): the chunks of the events handed over together, joined. An event
        that failed ends the body with the writer's failure chunk instead of its tail. EventStream
    closes `choices`."""
    if head := writer.head():
        yield b"".join(head)
    async for handover in choices:
        out = []
        for i, event in handover:
            if event.finish_reason == "error":
                yield b"".join([*out, writer.failure(event.error)])
                return
            out += writer.chunks(i, event)
        if out:
            yield b"".join(out)
    if tail := writer.tail():
        yield b"".join(tail)


class EventStream(StreamingResponse):
    """A text/event-stream response of `writer`'s chunks over `choices` that closes `choices`
    (its engine streams) however it ends: finished, failed, or cut off by the client before or
    while the body was sent."""

    def __init__(self, choices, writer: Writer):
        # proxies must pass events on at once instead of buffering them
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        headers |= id_headers(choices.request_id)
        body = writes(choices, writer)
        super().__init__(body, media_type="text/event-stream", headers=headers)
        self.choices = choices

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.choices.aclose()
