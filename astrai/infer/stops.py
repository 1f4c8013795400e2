"""Stop strings in streamed text: emit text as soon as it cannot be the start of a stop string.

The engine keeps the text it has decoded but not yet emitted ("unsent"). Whenever a suffix of the
text could still grow into a stop string it stays unsent, so a stop string split across tokens
is caught and no part of it ever reaches a stream.
"""

from __future__ import annotations


def scan_stops(unsent: str, stops: list[str]) -> tuple[str, str, str | None]:
    """Split unsent text into (emit now, keep unsent, matched stop string or None).

    On a match, the stop string that is complete first as the text grows wins (the earliest end;
    of two ending together, the longer), so the result does not depend on how the text was cut
    into pieces; everything before it is emitted and the rest dropped. Only unsent text is
    searched: emitted text never contains the start of a stop string.
    """
    if not stops:
        return unsent, "", None
    found = [(i + len(stop), i, stop) for stop in stops if (i := unsent.find(stop)) >= 0]
    if found:
        _, i, stop = min(found)
        return unsent[:i], "", stop
    keep = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(unsent)), keep, -1):
            if unsent.endswith(stop[:k]):
                keep = k
                break
    return unsent[: len(unsent) - keep], unsent[len(unsent) - keep :], None
