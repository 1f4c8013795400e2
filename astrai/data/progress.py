"""A one-line progress display on stderr, redrawn in place; no dependencies."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def progress_line(done: int, total: int, records: int, tokens: int, seconds: float) -> str:
    """`[#####.....]  52.1%  12.0/23.0 MB  10,234 records  2.1M tokens  350.2k tok/s`"""
    frac = done / total if total else 1.0
    bar = "#" * int(frac * 20)
    rate = tokens / seconds if seconds > 0 else 0.0
    return (
        f"[{bar:.<20}] {frac * 100:5.1f}%  {done / 1e6:.1f}/{total / 1e6:.1f} MB  "
        f"{records:,} records  {human(tokens)} tokens  {human(rate)} tok/s"
    )


def human(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def progress_printer(stream: TextIO = sys.stderr, every: float = 0.5, after: float = 1.0):
    """A function that redraws the line at most every `every` seconds, and only once a run has
    taken `after` seconds, so that small inputs print nothing; `final=True` ends the line."""
    start = time.monotonic()
    last = [0.0]
    shown = [False]

    def show(done: int, total: int, records: int, tokens: int, final: bool = False) -> None:
        now = time.monotonic()
        if not final and (now - start < after or now - last[0] < every):
            return
        if final and not shown[0]:
            return
        last[0], shown[0] = now, True
        stream.write("\r" + progress_line(done, total, records, tokens, now - start))
        stream.write("\n" if final else "")
        stream.flush()

    return show
