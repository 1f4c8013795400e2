"""What the Engine hands back: stream events, the iterator over them, completions, usage, and
its errors."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable

import msgspec


class PromptTooLong(ValueError):
    """prompt + max_tokens cannot fit max_seq_len or the page pool."""


class Overloaded(RuntimeError):
    """max_waiting requests are already waiting."""


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose K/V came from the prefix cache
    completion_tokens: int


class Logprob(msgspec.Struct, frozen=True):
    """A token's log-probability as OpenAI reports it (log_softmax of the raw logits) and the
    most likely tokens in its place. An echoed prompt's first token has neither (None)."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), most likely first


class StreamEvent(msgspec.Struct):
    """What one step produced for one request. Text is a delta that never holds part of a stop
    string or a broken UTF-8 character; the last event has a finish_reason and usage."""

    request_id: str
    text: str = ""
    token_ids: list[int] = []
    logprobs: list[Logprob] | None = None  # when the request asked for them
    finish_reason: str | None = None  # None | "stop" | "length" | "abort" | "error"
    usage: Usage | None = None
    error: str | None = None
    stop_reason_text: str | None = None  # the stop string or stop token text that matched


class Completion(msgspec.Struct):
    """A request's events joined: its whole text and tokens, and how it ended."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = []
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[Logprob] | None = None  # None unless the request asked for them
    stop_reason_text: str | None = None
    error: str | None = None


def add_event(completion: Completion, event: StreamEvent) -> None:
    """Join one more of the request's events into its completion, in place."""
    completion.request_id = event.request_id
    completion.text += event.text
    completion.token_ids += event.token_ids
    if event.logprobs is not None:
        completion.logprobs = [*(completion.logprobs or []), *event.logprobs]
    if event.finish_reason is not None:
        completion.finish_reason, completion.usage = event.finish_reason, event.usage
        completion.stop_reason_text, completion.error = event.stop_reason_text, event.error


def collect(events) -> Completion:
    """Join a request's events into its Completion."""
    completion = Completion()
    for event in events:
        add_event(completion, event)
    return completion


def wait_all(events: queue.SimpleQueue, request_ids: list[str]) -> list[Completion]:
    """Read events from one queue until every request in request_ids finished -> their
    Completions, in that order."""
    by_id: dict[str, list[StreamEvent]] = {rid: [] for rid in request_ids}
    remaining = len(by_id)
    while remaining:
        event = events.get()
        by_id[event.request_id].append(event)
        remaining -= event.finish_reason is not None
    return [collect(by_id[rid]) for rid in request_ids]


def wait_one(events: queue.SimpleQueue, request_id: str, timeout: float | None) -> Completion:
    """Read one request's events until it finished -> its Completion; TimeoutError after
    `timeout` seconds (None: wait), with the events read so far put back for a later call."""
    collected = []
    deadline = None if timeout is None else time.monotonic() + timeout
    while not collected or collected[-1].finish_reason is None:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            collected.append(events.get(timeout=wait))
        except queue.Empty:
            for event in collected:  # the queue is empty: they go back in order
                events.put(event)
            raise TimeoutError(f"request {request_id} is not done yet") from None
    return collect(collected)


class Events:
    """One request's events, read with `for` (sync) or `async for` (in an event loop): the
    one iterator of stream and astream. Leaving early (break, close, a cancelled task)
    cancels the request, which frees its pages."""

    def __init__(self, events: queue.SimpleQueue | asyncio.Queue, cancel: Callable[[], None]):
        self._events, self._cancel, self._done = events, cancel, False

    def _took(self, event: StreamEvent) -> StreamEvent:
        self._done = event.finish_reason is not None
        return event

    def __iter__(self) -> Events:
        return self

    def __next__(self) -> StreamEvent:
        if self._done:
            raise StopIteration
        try:
            return self._took(self._events.get())
        except BaseException:
            self.close()
            raise

    def __aiter__(self) -> Events:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        try:
            return self._took(await self._events.get())
        except BaseException:  # the reading task was cancelled
            self.close()
            raise

    def at_hand(self) -> bool:
        """Whether the next read returns without waiting (an event, or the end)."""
        return self._done or not self._events.empty()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._cancel()

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
