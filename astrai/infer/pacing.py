"""The Engine thread's other decisions, as pure functions of what it measured: whether one more
request may wait, when its stats snapshot is taken, the recent tokens per second. The thread
reads the clock and passes the time in; nothing here reads a clock."""

from __future__ import annotations

from collections.abc import Iterable

from astrai.infer.events import Overloaded

RATE_WINDOW_S = 10.0  # tokens_per_s averages over this much of the recent past


def check_room(waiting: int, max_waiting: int) -> None:
    """Raise Overloaded when `waiting` requests already wait and `max_waiting` (0: no limit)
    allows no more. One caller's batch is let in or refused as one, by the count before it."""
    if max_waiting and waiting >= max_waiting:
        raise Overloaded(f"{waiting} requests are already waiting (max_waiting)")


def stats_due(
    had_messages: bool, finals: bool, idle: bool, now: float, taken_at: float, interval: float
) -> bool:
    """Whether the thread takes a stats snapshot after a step: after new messages (a snapshot
    never predates a request it does not show), before final events go out (a caller holding
    its result never reads older stats), when the engine falls idle, and otherwise once it is
    `interval` seconds old."""
    return had_messages or finals or idle or now - taken_at > interval


def tokens_per_s(recent: Iterable[tuple[float, int]], now: float) -> float:
    """Tokens a second over the last RATE_WINDOW_S, from (time, tokens) of recent steps."""
    window = [(t, n) for t, n in recent if now - t <= RATE_WINDOW_S]
    span = now - window[0][0] if len(window) > 1 else 0.0
    return sum(n for _, n in window[1:]) / span if span > 0 else 0.0
