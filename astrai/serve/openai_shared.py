"""What OpenAI chat and text completions answer alike: finish reasons and a failure that comes
after the stream started."""

from __future__ import annotations

from astrai.serve import sse
from astrai.serve.errors import generation_failed, openai_body


def finish_reason(reason: str | None, called: bool) -> str | None:
    """The engine's reason as OpenAI names it; a stop after tool calls is `tool_calls`."""
    if reason == "stop" and called:
        return "tool_calls"
    return "stop" if reason == "abort" else reason


def error_event(reason: str | None) -> bytes:
    """A failure mid-stream, as `data: {"error": ...}`, which the client raises."""
    return sse.data(openai_body(generation_failed(reason)))
