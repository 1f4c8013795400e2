"""The names of a process's threads (Linux /proc), for tests that count OpenMP teams: a team's
threads carry the name of the thread that started it."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path


def thread_names(pid: int | str = "self") -> list[str]:
    return list(named_threads(pid).values())


def named_threads(pid: int | str = "self") -> dict[str, str]:
    """Each thread's id -> its name."""
    names = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            names[task.name] = (task / "comm").read_text().strip()
    return names


def threads_become(
    name: str, n: int, pid: int | str = "self", timeout: float = 10.0, besides=frozenset()
) -> bool:
    """Whether `n` threads carry `name` within `timeout` seconds, not counting the threads
    `besides` (ids: those of other tests' engines, which may end meanwhile)."""

    def count() -> int:
        return sum(t not in besides and v == name for t, v in named_threads(pid).items())

    deadline = time.monotonic() + timeout
    while count() != n and time.monotonic() < deadline:
        time.sleep(0.01)
    return count() == n
