"""When a request's events go to its reader: a pure function over plain data, and the hand-over.

Events that come within `stream_interval_ms` of a request's last hand-over wait and go out
together, because waking a reader costs CPU that on a small machine is the compute's. A
request's first events and its end go out at once. Readers woken together (the streams of one
asyncio event loop) form a group: when one of them is due, the loop wakes once and takes every
event waiting for the group.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from astrai.infer.events import StreamEvent


@dataclass(eq=False)
class Sink:
    """Where a caller's events go: `put(event)`, called on the engine thread, or with `loop`
    set, on that asyncio loop's thread."""

    put: Callable[[StreamEvent], None]
    loop: asyncio.AbstractEventLoop | None = None


class Pending(NamedTuple):
    """One request's events not yet handed to its reader."""

    group: object  # readers that wake together (an event loop); None: a reader of its own
    events: tuple[StreamEvent, ...] = ()
    sent_at: float | None = None  # when its events last went out; None: not yet


def is_due(pending: Pending, now: float, interval: float) -> bool:
    """Whether the pending events go out now: the first and the last at once, the others once
    `interval` seconds have passed since the last went out."""
    return bool(pending.events) and (
        pending.sent_at is None
        or pending.events[-1].finish_reason is not None
        or now - pending.sent_at >= interval
    )


def hand_over(
    pending: dict[str, Pending], events: list[StreamEvent], now: float, interval: float
) -> tuple[dict[str, Pending], list[tuple[str, tuple[StreamEvent, ...]]]]:
    """Add a step's events to what waits -> (what waits now, [(request id, events)] to hand
    over now). A request whose last event goes out is dropped; events of requests not in
    `pending` are dropped too (their reader is gone)."""
    waiting = dict(pending)
    for event in events:
        if (p := waiting.get(event.request_id)) is not None:
            waiting[event.request_id] = Pending(p.group, (*p.events, event), p.sent_at)
    ready = [(rid, p, is_due(p, now, interval)) for rid, p in waiting.items() if p.events]
    woken = {p.group for _, p, due in ready if due} - {None}
    out = []
    for rid, p, due in ready:
        if due or p.group in woken:  # a group woken anyway takes every event waiting for it
            out.append((rid, p.events))
            if p.events[-1].finish_reason is not None:
                del waiting[rid]
            else:
                waiting[rid] = Pending(p.group, (), now)
    return waiting, out


def _put_all(items: list[tuple[Callable, StreamEvent]]) -> None:
    for put, event in items:
        put(event)


def deliver(sinks: dict[str, Sink], due: list[tuple[str, tuple[StreamEvent, ...]]]) -> None:
    """Hand the due events to their sinks, an event loop's all in one wake-up of that loop.
    A sink whose request ended is dropped from `sinks`."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for request_id, events in due:
        sink = sinks[request_id]
        if events[-1].finish_reason is not None:
            del sinks[request_id]
        if sink.loop is not None:
            by_loop.setdefault(sink.loop, []).extend((sink.put, e) for e in events)
            continue
        for event in events:
            with contextlib.suppress(Exception):  # a reader that went away must not stop us
                sink.put(event)
    for loop, items in by_loop.items():
        with contextlib.suppress(Exception):  # e.g. a closed event loop
            loop.call_soon_threadsafe(_put_all, items)
