"""The Engine's thread: it takes the callers' messages, advances the engine state with
`engine_step` and hands each request's events to its reader. Only this thread touches the
engine state and runs torch work, so neither needs a lock; every decision it takes is a call
into a pure function (scheduler.decode_run_length, delivery.hand_over, pacing)."""

from __future__ import annotations

import queue
import time
from collections import deque

import msgspec
import torch

from astrai.config import EngineConfig, ModelConfig
from astrai.infer.adapters import AdapterInfo, adapter_bytes, adapter_list
from astrai.infer.delivery import Pending, Sink, deliver, hand_over
from astrai.infer.events import StreamEvent, Usage
from astrai.infer.hardware import name_native_thread, release_thread_team
from astrai.infer.inbox import (
    Call,
    Cancel,
    ChangeState,
    Close,
    Message,
    Started,
    Submit,
    SwapParams,
    Waiting,
)
from astrai.infer.pacing import stats_due, tokens_per_s
from astrai.infer.prepare import kernels_used, prepare_params
from astrai.infer.resolve import params_for
from astrai.infer.sequence import Sequence
from astrai.infer.state import (
    cancel_request,
    describe,
    end_all,
    enqueue,
    forget_cached_kv,
    has_work,
    init_engine,
)
from astrai.infer.stats import EngineStats, engine_stats
from astrai.infer.step import engine_step
from astrai.model.lora_folder import UnknownAdapter

THREAD_NAME = "astrai-engine"


class EngineLoop:
    """The engine thread's state: the engine state, the prepared weights, the events on their
    way to readers and what it measured. `config`, `kernels` and `snapshot` are what callers
    read; each is replaced whole, never changed in place."""

    def __init__(self, cfg: ModelConfig, tokenizer, inbox: queue.SimpleQueue, waiting: Waiting):
        self.cfg, self.tokenizer, self.inbox, self.waiting = cfg, tokenizer, inbox, waiting
        self.config: EngineConfig | None = None
        self.kernels: dict[str, int] = {}  # which product each matrix runs, for the logs
        self.snapshot: EngineStats | None = None
        self.adapters: dict[str, AdapterInfo] = {}  # the loaded adapters, by name
        self.adapter_bytes = 0  # what their stack holds
        self._pending: dict[str, Pending] = {}
        self._sinks: dict[str, Sink] = {}
        self._recent: deque[tuple[float, int]] = deque(maxlen=256)  # (time, tokens) per step
        self._step_seconds: float | None = None  # the last engine step's time per model step
        self._started_at = time.monotonic()

    def run(self, params, config: EngineConfig | None, settings: dict, started: Started) -> None:
        name_native_thread(THREAD_NAME)  # before its OpenMP team exists: the team inherits it
        with torch.inference_mode():
            try:
                params = params() if callable(params) else params
                self._state = init_engine(params, self.cfg, self.tokenizer, config, **settings)
                self.config = self._state.engine_config
                self._params = self._prepare(params)
                del params  # the prepared copy is what the engine keeps
                self._take_snapshot(time.monotonic())
            except BaseException as exc:
                started.error = exc
                return
            finally:
                started.done.set()
            while (had_messages := self._handle_messages()) is not None:
                self._step(had_messages)

    def _prepare(self, params):
        prepared = prepare_params(params_for(self.config, params), self.config.quantize)
        self.kernels = kernels_used(prepared)
        return prepared

    def _handle_messages(self) -> bool | None:
        """Take every message waiting (block for one when idle). Returns whether there were
        any, or None once closed."""
        block, had_messages = not has_work(self._state), False
        while True:
            if block and self.inbox.empty():  # idle: no team of ours to slow another thread's
                release_thread_team()
            try:
                message = self.inbox.get(block=block)
            except queue.Empty:
                return had_messages
            block, had_messages = False, True
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
                self._enqueue(seqs, sink)
            case Cancel(request_id):
                self._state = cancel_request(self._state, request_id)
            case SwapParams(params, done):
                try:
                    self._params = self._prepare(params)
                    self._state = forget_cached_kv(self._state)
                except Exception as exc:
                    message.error = exc
                finally:
                    self._take_snapshot(time.monotonic())
                    done.set()
            case Call(fn, done):
                try:
                    message.result = fn(self._params)
                except Exception as exc:
                    message.error = exc
                finally:
                    done.set()
            case ChangeState(fn, done):
                try:
                    self._state, message.result = fn(self._state)
                    self.adapters = {info.name: info for info in adapter_list(self._state)}
                    self.adapter_bytes = adapter_bytes(self._state)
                except Exception as exc:
                    message.error = exc
                finally:
                    done.set()

    def _enqueue(self, seqs: list[Sequence], sink: Sink) -> None:
        for seq in seqs:
            self._sinks[seq.id] = sink
            self._pending[seq.id] = Pending(sink.loop)
            try:
                self._state = enqueue(self._state, seq)
            except UnknownAdapter as exc:  # unloaded after the caller checked: this one fails
                usage = Usage(prompt_tokens=seq.prompt_len, cached_tokens=0, completion_tokens=0)
                failed = StreamEvent(
                    request_id=seq.id, finish_reason="error", usage=usage, error=describe(exc)
                )
                self._state.final_events.append(failed)
        self.waiting.taken(len(seqs), len(self._state.sched.waiting))

    def _step(self, had_messages: bool) -> None:
        events: list[StreamEvent] = []
        busy = has_work(self._state)
        started, steps = time.monotonic(), self._state.totals.steps
        if busy:
            try:
                self._state, events = engine_step(
                    self._state, self._params, self._step_seconds, time.perf_counter
                )
            except Exception as exc:  # never let the thread die with callers waiting
                self._state = end_all(self._state, "error", describe(exc))
                self._state, events = engine_step(self._state, self._params)
            self.waiting.taken(0, len(self._state.sched.waiting))
        now = time.monotonic()
        if (ran := self._state.totals.steps - steps) > 0:
            self._step_seconds = (now - started) / ran
        if busy:
            self._recent.append((now, sum(len(e.token_ids) for e in events)))
        finals = any(e.finish_reason is not None for e in events)
        idle = not has_work(self._state)
        interval = self.config.stats_interval_ms / 1000
        if stats_due(had_messages, finals, idle, now, self._snapshot_at, interval):
            self._take_snapshot(now)
        self._deliver(events, now)

    def _deliver(self, events: list[StreamEvent], now: float) -> None:
        interval = self.config.stream_interval_ms / 1000
        self._pending, due = hand_over(self._pending, events, now, interval)
        deliver(self._sinks, due)

    def _shut_down(self) -> None:
        """Abort every request, also those whose submission raced with close."""
        while True:
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                break
            match message:
                case Submit(seqs, sink):
                    self._enqueue(seqs, sink)
                case SwapParams(_, done) | Call(_, done) | ChangeState(_, done):
                    message.error = RuntimeError("the engine is closed")
                    done.set()
        self._state = end_all(self._state, "abort")
        self._state, events = engine_step(self._state, self._params)
        self._take_snapshot(time.monotonic())
        self._deliver(events, time.monotonic())

    def _take_snapshot(self, now: float) -> None:
        stats = engine_stats(self._state)
        self._snapshot_at = now
        self.snapshot = msgspec.structs.replace(
            stats,
            waiting=stats.waiting + self.waiting.sent,
            tokens_per_s=tokens_per_s(self._recent, now),
            uptime_s=now - self._started_at,
        )
