"""The messages callers send to the Engine thread: one typed union, matched by class."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from astrai.infer.delivery import Sink
from astrai.infer.sequence import Sequence


@dataclass
class Submit:
    """Sequences that join together, before the same step (a generate call's batch)."""

    seqs: list[Sequence]
    sink: Sink


@dataclass
class Cancel:
    request_id: str


@dataclass
class SwapParams:
    params: dict
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None  # why the swap failed (the old weights stay)


@dataclass
class Call:
    fn: Callable[[dict], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: Exception | None = None


@dataclass
class Close:
    pass


@dataclass
class Started:
    """The engine thread's answer to the constructor: ready, or why it could not start."""

    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


Message = Submit | Cancel | SwapParams | Call | Close
