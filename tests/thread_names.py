"""The names of a process's threads (Linux /proc), for tests that count OpenMP teams: a team's
threads carry the name of the thread that started it."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path


def thread_names(pid: int | str = "self") -> list[str]:
    names = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            names.append((task / "comm").read_text().strip())
    return names


def threads_become(name: str, n: int, pid: int | str = "self", timeout: float = 10.0) -> bool:
    """Whether `n` threads carry `name` within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while thread_names(pid).count(name) != n and time.monotonic() < deadline:
        time.sleep(0.01)
    return thread_names(pid).count(name) == n
