"""A streamed completion as the client saw it: the network reads of its Server-Sent Events,
each stamped when it arrived, turned into one arrival time per token afterwards (so reading
the stream costs the client no parsing while it lasts).

Tokens handed over together (the engine hands a stream its tokens every stream_interval_ms,
a decode run's at once) arrive in one read and share its time: the gaps between distinct times
are the hand-overs, and a request's time per output token comes from its first and last."""

from __future__ import annotations

from itertools import pairwise
from typing import NamedTuple

import msgspec


class Arrivals(NamedTuple):
    stamps: list[float]  # per event with text (one per token): when the read ending it came
    text: str
    completion_tokens: int | None  # from the usage in the final event
    finish_reason: str | None


def token_arrivals(reads: list[tuple[float, bytes]]) -> Arrivals:
    """(arrival time, bytes) of each read of an OpenAI completions stream -> its arrivals."""
    stamps, texts, tokens, finish = [], [], None, None
    pending = b""
    for stamp, data in reads:
        *events, pending = (pending + data).split(b"\n\n")
        for event in events:
            for line in event.splitlines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = msgspec.json.decode(line[6:])
                for choice in chunk.get("choices") or []:
                    finish = choice.get("finish_reason") or finish
                    if choice.get("text"):
                        stamps.append(stamp)
                        texts.append(choice["text"])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return Arrivals(stamps, "".join(texts), tokens, finish)


def time_per_output_token(stamps: list[float]) -> float | None:
    """(last token - first token) / (tokens - 1), vLLM's TPOT: the same on every side whether
    tokens come one by one or handed over in groups; None for fewer than two tokens."""
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None


def handover_gaps(stamps: list[float]) -> list[float]:
    """The gaps between a request's successive hand-overs (distinct arrival times)."""
    return [b - a for a, b in pairwise(dict.fromkeys(stamps))]
