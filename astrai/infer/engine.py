"""Engine: `engine_step` on a background thread, for servers and batch jobs.

Callers on any thread send messages to the thread's inbox and read their request's events
from a queue of their own. Only the engine thread touches the engine state, so it needs no
locks; all torch work of the engine runs on that one thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from astrai.config import EngineConfig, ModelConfig
from astrai.infer.events import Completion, Events, Overloaded, StreamEvent, collect
from astrai.infer.prepare import kernels_used, prepare_params
from astrai.infer.sampling import SamplingParams, sampling_params
from astrai.infer.sequence import Sequence
from astrai.infer.step import (
    Request,
    cancel_request,
    describe,
    end_all,
    engine_stats,
    engine_step,
    enqueue,
    forget_cached_kv,
    has_work,
    init_engine,
    new_sequence,
    params_for,
)

Params = dict[str, torch.Tensor]
THREAD_NAME = "astrai-engine"
RUN_SECONDS = 0.02  # the longest run of decode steps the Engine starts (see _run_length)


def name_native_thread(name: str) -> None:
    """Give the calling OS thread a name (Linux; elsewhere nothing happens), so that tools such
    as top -H, and the threads it starts, show where they come from."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


@dataclass(eq=False)
class Sink:
    """Where a caller's events go: `put(event)`, called on the engine thread, or with `loop`
    set, on that asyncio loop's thread."""

    put: Callable[[StreamEvent], None]
    loop: asyncio.AbstractEventLoop | None = None


@dataclass(eq=False)
class _Outbox:
    """One request's events on their way to its sink."""

    sink: Sink
    held: list[StreamEvent] = field(default_factory=list)
    sent_at: float | None = None  # when its events last went out; None: not yet

    def due(self, now: float, interval: float) -> bool:
        """Whether the held events go out now: the first and the last at once, the others
        once `interval` has passed since the last went out."""
        return bool(self.held) and (
            self.sent_at is None
            or self.held[-1].finish_reason is not None
            or now - self.sent_at >= interval
        )


def _put_all(items: list[tuple[Callable, StreamEvent]]) -> None:
    for put, event in items:
        put(event)


# The inbox's messages: one typed union, matched by class.
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
    params: dict[str, torch.Tensor]
    done: threading.Event = field(default_factory=threading.Event)
    error: Exception | None = None  # why the swap failed (the old weights stay)


@dataclass
class Call:
    fn: Callable[[dict[str, torch.Tensor]], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: Exception | None = None


@dataclass
class Close:
    pass


@dataclass
class _Started:
    """The engine thread's answer to the constructor: ready, or why it could not start."""

    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


Message = Submit | Cancel | SwapParams | Call | Close


@dataclass
class Clock:
    """What the engine thread measures in time: uptime and recent tokens per step."""

    started: float = field(default_factory=time.monotonic)
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, tokens)

    def tokens_per_s(self, now: float) -> float:
        window = [(t, n) for t, n in self.recent if now - t <= 10.0]
        span = now - window[0][0] if len(window) > 1 else 0.0
        return sum(n for _, n in window[1:]) / span if span > 0 else 0.0


class Engine:
    """Continuous-batching generation over a model, on a background thread.

    engine.generate(prompts, **sampling) blocks for a batch; submit/result, stream and astream
    serve one request each. Sampling keyword arguments are the fields of SamplingParams;
    settings are the fields of EngineConfig, as `config` and/or keyword arguments.
    """

    def __init__(
        self,
        params: Params | Callable[[], Params],
        cfg: ModelConfig,
        tokenizer,
        config: EngineConfig | None = None,
        **settings,
    ):
        # All torch work happens on the engine thread, loading included: a second thread that
        # has run one parallel op keeps its own OpenMP team alive, and two teams on a machine
        # with as many cores as one team's threads make every small op of a step sleep and
        # wake (measured ~2.3x slower decoding). So `params` may be a function that loads them.
        self.cfg, self.tokenizer = cfg, tokenizer
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()  # C: cheap to poll
        self._queued = 0  # submissions not yet seen by the engine thread
        self._lock = threading.Lock()
        self._outboxes: dict[str, _Outbox] = {}  # engine thread only
        self._results: dict[str, queue.SimpleQueue] = {}
        self._counter = itertools.count()
        self._clock = Clock()
        self._step_seconds = 0.0  # the last engine step's time per model step
        self._closed = False
        started = _Started()
        self._thread = threading.Thread(
            target=self._run,
            args=(params, config, settings, started),
            name=THREAD_NAME,
            daemon=True,
        )
        self._thread.start()
        started.done.wait()
        if started.error is not None:
            self._thread.join()
            raise started.error
        self.config = self._state.config
        self.max_seq_len = self.config.max_seq_len

    @classmethod
    def from_pretrained(
        cls, path, config: EngineConfig | None = None, tokenizer=None, **settings
    ) -> Engine:
        """An Engine over the model folder `path` (written by `save_pretrained` or transformers),
        its weights read on the engine thread. The tokenizer is the folder's unless given."""
        from pathlib import Path

        from astrai.model import load_pretrained, model_config_from_json
        from astrai.tokenizer import Tokenizer

        path = Path(path)
        cfg = model_config_from_json(path / "config.json")
        if tokenizer is None:
            tokenizer = Tokenizer.from_pretrained(path)
        return cls(lambda: load_pretrained(path)[0], cfg, tokenizer, config, **settings)

    # ------------------------------------------------------------------ public API

    def generate(self, prompts: list[str | list[int]], **sampling) -> list[Completion]:
        """Generate for every prompt, batched (all join before the same step, so the batches,
        and the numbers, do not depend on timing); blocks until all are done."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate takes a list of prompts; use submit or stream for one")
        events: queue.SimpleQueue = queue.SimpleQueue()
        seqs = [self._sequence(p, sampling) for p in prompts]
        self._send(seqs, Sink(events.put))  # one caller's work: checked against max_waiting once
        by_id: dict[str, list[StreamEvent]] = {seq.id: [] for seq in seqs}
        remaining = len(seqs)
        while remaining:
            event = events.get()
            by_id[event.request_id].append(event)
            remaining -= event.finish_reason is not None
        return [collect(by_id[seq.id]) for seq in seqs]

    def submit(self, prompt: str | list[int], **sampling) -> str:
        """Queue one request and return its id at once; `result(id)` waits for it."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        seq = self._sequence(prompt, sampling)
        self._results[seq.id] = events
        self._send([seq], Sink(events.put))
        return seq.id

    def result(self, request_id: str, timeout: float | None = None) -> Completion:
        """The Completion of a submitted request (blocks until it finishes)."""
        events = self._results.get(request_id)
        if events is None:
            raise KeyError(f"no submitted request {request_id!r} waits for its result")
        collected = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while not collected or collected[-1].finish_reason is None:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                collected.append(events.get(timeout=wait))
            except queue.Empty:
                for event in reversed(collected):  # keep what was read for a later call
                    events.put(event)
                raise TimeoutError(f"request {request_id} is not done yet") from None
        del self._results[request_id]
        return collect(collected)

    def stream(self, prompt: str | list[int], **sampling) -> Events:
        """Submit now; iterate the request's events. Leaving the loop early cancels it."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        seq = self._sequence(prompt, sampling)
        self._send([seq], Sink(events.put))
        return Events(events, lambda: self.cancel(seq.id))

    def astream(self, prompt: str | list[int], request_id: str | None = None, **sampling) -> Events:
        """stream() for an asyncio event loop: call it inside the loop. Closing the iterator or
        cancelling the task that reads it cancels the request and frees its pages.
        `request_id` names the request in its events (a server passes its own, so that one id
        follows a request through both); it must differ from every other live request's."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        seq = self._sequence(prompt, sampling, request_id)
        self._send([seq], Sink(events.put_nowait, loop))
        return Events(events, lambda: self.cancel(seq.id))

    def cancel(self, request_id: str) -> None:
        """Stop a request; it finishes with finish_reason "abort" and its pages are freed."""
        self._inbox.put(Cancel(request_id))

    def update_params(self, params: dict[str, torch.Tensor]) -> None:
        """Swap the weights between two steps (e.g. after an RL update) and clear the prefix
        cache. Running requests go on with the new weights. Blocks until the swap is done."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        swap = SwapParams(params)
        self._inbox.put(swap)
        swap.done.wait()
        if swap.error is not None:
            raise swap.error

    def call(self, fn: Callable[[dict[str, torch.Tensor]], Any]) -> Any:
        """`fn(weights)` run on the engine thread between two steps, with the weights the engine
        decodes with (read them, don't change them), and its result; blocks until done. Torch
        work of the process stays on the one compute thread (e.g. `forward` to score a prompt)."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        call = Call(fn)
        self._inbox.put(call)
        call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result

    def stats(self) -> dict:
        """Running and waiting requests, pages, prefix-cache hit rate, tokens/s and totals,
        as of the last snapshot (taken between steps, at least every 50 ms while busy)."""
        stats = dict(self._snapshot)
        del stats["at"]
        return stats

    def close(self) -> None:
        """Abort what is left and stop the engine thread."""
        if not self._closed:
            self._closed = True
            self._inbox.put(Close())
        self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ caller side

    def _prepare(self, params):
        prepared = prepare_params(params_for(self._state, params), self._state.config.quantize)
        self.kernels = kernels_used(prepared)  # which product each matrix runs, for the logs
        return prepared

    def _sequence(self, prompt, sampling: dict, request_id: str | None = None) -> Sequence:
        if self._closed:
            raise RuntimeError("the engine is closed")
        sp = sampling if isinstance(sampling, SamplingParams) else sampling_params(**sampling)
        request_id = request_id or f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
        return new_sequence(self._state, Request(request_id, prompt, sp))

    def _check_waiting(self) -> None:
        limit = self.config.max_waiting
        waiting = self._queued + len(self._state.sched.waiting)
        if limit and waiting >= limit:
            raise Overloaded(f"{waiting} requests are already waiting (max_waiting)")

    def _send(self, seqs: list[Sequence], sink: Sink) -> None:
        with self._lock:
            self._check_waiting()
            self._queued += len(seqs)
        self._inbox.put(Submit(seqs, sink))

    # ------------------------------------------------------------------ engine thread

    def _run(self, params, config, settings, started: _Started) -> None:
        name_native_thread(THREAD_NAME)  # before its OpenMP team exists: the team inherits it
        with torch.inference_mode():
            try:
                params = params() if callable(params) else params
                self._state = init_engine(params, self.cfg, self.tokenizer, config, **settings)
                self._params = self._prepare(params)
                del params  # the prepared copy is what the engine keeps
                self._refresh_snapshot()
            except BaseException as exc:
                started.error = exc
                return
            finally:
                started.done.set()
            while (news := self._handle_messages()) is not None:
                self._step(news)

    def _handle_messages(self) -> bool | None:
        """Take every message waiting (block for one when idle). Returns whether there were
        any, or None once closed."""
        block, news = not has_work(self._state), False
        while True:
            try:
                message = self._inbox.get(block=block)
            except queue.Empty:
                return news
            block, news = False, True
            if isinstance(message, Close):
                self._shut_down()
                return None
            try:
                self._take(message)
            except Exception as exc:  # a bad message must not stop the engine
                self._state = end_all(self._state, "error", describe(exc))

    def _take(self, message: Message) -> None:
        match message:
            case Submit(seqs, sink):
                with self._lock:
                    self._queued -= len(seqs)
                for seq in seqs:
                    self._outboxes[seq.id] = _Outbox(sink)
                    self._state = enqueue(self._state, seq)
            case Cancel(request_id):
                self._state = cancel_request(self._state, request_id)
            case SwapParams(params, done):
                try:
                    self._params = self._prepare(params)
                    self._state = forget_cached_kv(self._state)
                except Exception as exc:
                    message.error = exc
                finally:
                    self._refresh_snapshot()
                    done.set()
            case Call(fn, done):
                try:
                    message.result = fn(self._params)
                except Exception as exc:
                    message.error = exc
                finally:
                    done.set()

    def _step(self, news: bool) -> None:
        events: list[StreamEvent] = []
        busy = has_work(self._state)
        started, steps = time.monotonic(), self._state.totals.steps
        if busy:
            try:
                self._state, events = engine_step(self._state, self._params, self._run_length())
            except Exception as exc:  # never let the thread die with callers waiting
                self._state = end_all(self._state, "error", describe(exc))
                self._state, events = engine_step(self._state, self._params, 1)
        now = time.monotonic()
        if (ran := self._state.totals.steps - steps) > 0:
            self._step_seconds = (now - started) / ran
        if busy:
            self._clock.recent.append((now, sum(len(e.token_ids) for e in events)))
        finals = any(e.finish_reason is not None for e in events)
        # While busy, at most 20 snapshots a second (counting pages is not free); one after
        # new messages, so a snapshot never predates a request it does not show; one before
        # final events go out, so a caller who has its result never reads older stats.
        stale = now - self._snapshot["at"] > 0.05
        if news or finals or stale or not has_work(self._state):
            self._refresh_snapshot()
        self._dispatch(events, now)

    def _run_length(self) -> int:
        """How many decode steps the next engine step may run back to back: one while messages
        wait (a new request, a cancel), else up to `decode_run` taking about RUN_SECONDS by the
        last step's time, so a run never holds a new request back for long."""
        if not self._inbox.empty():
            return 1
        # rounded, not cut: a step's time includes the engine's own, and at 6.7 ms a step
        # cutting 2.98 to 2 ran a float32 stream at batch 1 two tokens a run instead of three
        fit = round(RUN_SECONDS / max(self._step_seconds, 1e-6))
        return max(1, min(self._state.config.decode_run, fit))

    def _dispatch(self, events: list[StreamEvent], now: float) -> None:
        """Hand the events to their sinks, an event loop's all in one wake-up of that loop.
        Events that come within `stream_interval_ms` of a request's last ones are held (see
        EngineConfig): waking a reader costs CPU that on a small machine is the compute's."""
        for event in events:
            if (box := self._outboxes.get(event.request_id)) is not None:
                box.held.append(event)
        interval = self._state.config.stream_interval_ms / 1000
        ready = [(box, box.due(now, interval)) for box in self._outboxes.values() if box.held]
        woken = {box.sink.loop for box, is_due in ready if is_due} - {None}
        # a loop woken anyway takes every event held for it
        due = [box for box, is_due in ready if is_due or box.sink.loop in woken]
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for box in due:
            out, box.held, box.sent_at = box.held, [], now
            if out[-1].finish_reason is not None:
                self._outboxes.pop(out[-1].request_id, None)
            if box.sink.loop is not None:
                by_loop.setdefault(box.sink.loop, []).extend((box.sink.put, e) for e in out)
                continue
            for event in out:
                # a reader that went away must not stop the engine
                with contextlib.suppress(Exception):
                    box.sink.put(event)
        for loop, items in by_loop.items():
            with contextlib.suppress(Exception):  # e.g. a closed event loop
                loop.call_soon_threadsafe(_put_all, items)

    def _shut_down(self) -> None:
        """Abort every request, also those whose submission raced with close."""
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            match message:
                case Submit(seqs, sink):
                    for seq in seqs:
                        self._outboxes[seq.id] = _Outbox(sink)
                        self._state = enqueue(self._state, seq)
                case SwapParams(_, done) | Call(_, done):
                    message.error = RuntimeError("the engine is closed")
                    done.set()
        self._state = end_all(self._state, "abort")
        self._state, events = engine_step(self._state, self._params)
        self._refresh_snapshot()
        self._dispatch(events, time.monotonic())

    def _refresh_snapshot(self) -> None:
        now = time.monotonic()
        stats = engine_stats(self._state)
        self._snapshot = {
            **stats,
            "at": now,
            "waiting": stats["waiting"] + self._queued,
            "tokens_per_s": self._clock.tokens_per_s(now),
            "uptime_s": now - self._clock.started,
        }
