"""Server-Sent Events, framed as the official OpenAI and Anthropic clients parse them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
from starlette.responses import StreamingResponse

_encode = msgspec.json.Encoder().encode

DONE = b"data: [DONE]\n\n"


def data(obj) -> bytes:
    """OpenAI: one `data:` line per event, the stream ends with `data: [DONE]`."""
    return b"data: " + _encode(obj) + b"\n\n"


def named(name: str, obj) -> bytes:
    """Anthropic: every event names its type in an `event:` line."""
    return b"event: " + name.encode() + b"\ndata: " + _encode(obj) + b"\n\n"


class EventStream(StreamingResponse):
    """A text/event-stream response that closes `choices` (its engine streams) however it
    ends: finished, failed, or cut off by the client before or while the body was sent."""

    def __init__(self, body: AsyncIterator[bytes], choices):
        # proxies must pass events on at once instead of buffering them
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(_joined(body, choices), media_type="text/event-stream", headers=headers)
        self.choices = choices

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.choices.aclose()


async def _joined(body: AsyncIterator[bytes], choices) -> AsyncIterator[bytes]:
    """The body's events, those at hand together joined into one write: the engine hands a
    stream its tokens a few at a time, and each write costs the event loop a trip through the
    ASGI layers and a system call (half its time per token at one stream), time taken from the
    thread that runs the model. Nothing waits to be joined: an event goes out as soon as the
    next one is not already there."""
    held = []
    async for chunk in body:
        held.append(chunk)
        if not choices.at_hand():
            yield b"".join(held)
            held.clear()
    if held:
        yield b"".join(held)
