"""What callers and the Engine thread share: the messages callers send (one typed union,
matched by class) and the count of requests waiting, which admission reads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from astrai.infer.delivery import Sink
from astrai.infer.pacing import check_room
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
class ChangeState:
    """fn(engine state) -> (engine state, result), run on the engine thread between two steps
    (loading and unloading adapters); an error leaves the state as it was."""

    fn: Callable[[Any], tuple[Any, Any]]
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


Message = Submit | Cancel | SwapParams | Call | ChangeState | Close


@dataclass(eq=False)
class Waiting:
    """Requests that wait: those sent and not yet taken by the engine thread (callers add, the
    thread takes), and those waiting in its state as the thread last counted them. Callers
    never read the engine state; they read these."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    sent: int = 0
    in_state: int = 0

    def admit(self, n: int, max_waiting: int) -> None:
        """n requests of one caller join, or Overloaded (see pacing.check_room)."""
        with self.lock:
            check_room(self.sent + self.in_state, max_waiting)
            self.sent += n

    def taken(self, n: int, in_state: int) -> None:
        """The thread took n sent requests; `in_state` wait in its state now."""
        with self.lock:
            self.sent -= n
            self.in_state = in_state
