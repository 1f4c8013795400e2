"""What the Engine hands back: stream events, completions, usage, and its errors."""

from __future__ import annotations

import msgspec


class PromptTooLong(ValueError):
    """prompt + max_tokens cannot fit max_seq_len or the page pool."""


class Overloaded(RuntimeError):
    """max_waiting requests are already waiting."""


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache
    completion_tokens: int


class StreamEvent(msgspec.Struct):
    """What one step produced for one request. Text is a delta that never holds part of a stop
    string or a broken UTF-8 character; the last event has a finish_reason and usage."""

    request_id: str
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[dict] | None = None  # [{"token_id", "logprob", "top": [(id, logprob)]}]
    finish_reason: str | None = None  # None | "stop" | "length" | "abort" | "error"
    usage: Usage | None = None
    error: str | None = None
    stop_reason_text: str | None = None  # the stop string or stop token text that matched


class Completion(msgspec.Struct):
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    logprobs: list[dict] | None = None
    stop_reason_text: str | None = None
    error: str | None = None


def collect(events) -> Completion:
    """Join a request's events into its Completion."""
    events = list(events)
    last = events[-1]
    logprobs = [lp for e in events for lp in (e.logprobs or [])]
    return Completion(
        request_id=last.request_id,
        text="".join(e.text for e in events),
        token_ids=[t for e in events for t in e.token_ids],
        finish_reason=last.finish_reason,
        usage=last.usage,
        logprobs=logprobs if any(e.logprobs is not None for e in events) else None,
        stop_reason_text=last.stop_reason_text,
        error=last.error,
    )
