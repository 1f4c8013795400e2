"""Engine: `engine_step` on a background thread, for servers and batch jobs.

Callers on any thread send messages to the thread's inbox and read their request's events
from a queue of their own. Only the engine thread touches the engine state, so it needs no
locks; all torch work of the engine runs on that one thread.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from astrai.config import EngineConfig, ModelConfig
from astrai.infer.delivery import Pending, Sink, deliver, hand_over
from astrai.infer.events import Completion, Events, StreamEvent, wait_all, wait_one
from astrai.infer.hardware import name_native_thread
from astrai.infer.inbox import Call, Cancel, Close, Message, Started, Submit, SwapParams
from astrai.infer.pacing import check_room, stats_due, tokens_per_s
from astrai.infer.prepare import kernels_used, prepare_params
from astrai.infer.requests import Request, new_sequence
from astrai.infer.resolve import params_for
from astrai.infer.sampling import SamplingParams, with_fields
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
from astrai.model import Params

THREAD_NAME = "astrai-engine"
Sampling = SamplingParams | None


class Engine:
    """Continuous-batching generation over a model, on a background thread.

    engine.generate(prompts, sampling) blocks for a batch; submit/result, stream and astream
    serve one request each. Each takes a SamplingParams and/or its fields as keyword
    arguments (which win); settings are the fields of EngineConfig, as `config` and/or keyword
    arguments.
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
        self._lock = threading.Lock()  # guards the two counts below
        self._queued = 0  # submitted requests the engine thread has not taken yet
        self._waiting = 0  # requests waiting in the engine state, as the thread last counted
        self._pending: dict[str, Pending] = {}  # engine thread only, as are the three below
        self._sinks: dict[str, Sink] = {}
        self._recent: deque[tuple[float, int]] = deque(maxlen=256)  # (time, tokens) per step
        self._step_seconds: float | None = None  # the last engine step's time per model step
        self._results: dict[str, queue.SimpleQueue] = {}
        self._counter = itertools.count()
        self._started_at = time.monotonic()
        self._closed = False
        started = Started()
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

    def generate(
        self, prompts: list[str | list[int]], sampling: Sampling = None, **fields
    ) -> list[Completion]:
        """Generate for every prompt, batched (all join before the same step, so the batches,
        and the numbers, do not depend on timing); blocks until all are done."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate takes a list of prompts; use submit or stream for one")
        events: queue.SimpleQueue = queue.SimpleQueue()
        seqs = [self._sequence(p, sampling, fields) for p in prompts]
        self._send(seqs, Sink(events.put))  # one caller's work: checked against max_waiting once
        return wait_all(events, [seq.id for seq in seqs])

    def submit(self, prompt: str | list[int], sampling: Sampling = None, **fields) -> str:
        """Queue one request and return its id at once; `result(id)` waits for it."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        seq = self._sequence(prompt, sampling, fields)
        self._results[seq.id] = events
        self._send([seq], Sink(events.put))
        return seq.id

    def result(self, request_id: str, timeout: float | None = None) -> Completion:
        """The Completion of a submitted request (blocks until it finishes)."""
        events = self._results.get(request_id)
        if events is None:
            raise KeyError(f"no submitted request {request_id!r} waits for its result")
        completion = wait_one(events, request_id, timeout)
        del self._results[request_id]
        return completion

    def stream(self, prompt: str | list[int], sampling: Sampling = None, **fields) -> Events:
        """Submit now; iterate the request's events. Leaving the loop early cancels it."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        seq = self._sequence(prompt, sampling, fields)
        self._send([seq], Sink(events.put))
        return Events(events, lambda: self.cancel(seq.id))

    def astream(self, prompt: str | list[int], sampling: Sampling = None, **fields) -> Events:
        """stream() for an asyncio event loop: call it inside the loop. Closing the iterator or
        cancelling the task that reads it cancels the request and frees its pages."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        seq = self._sequence(prompt, sampling, fields)
        self._send([seq], Sink(events.put_nowait, loop))
        return Events(events, lambda: self.cancel(seq.id))

    def cancel(self, request_id: str) -> None:
        """Stop a request; it finishes with finish_reason "abort" and its pages are freed."""
        self._inbox.put(Cancel(request_id))

    def update_params(self, params: dict[str, torch.Tensor]) -> None:
        """Swap the weights between two steps (e.g. after an RL update) and clear the prefix
        cache. Running requests go on with the new weights. Blocks until the swap is done."""
        self._ask(SwapParams(params))

    def call(self, fn: Callable[[Params], Any]) -> Any:
        """`fn(weights)` run on the engine thread between two steps, with the weights the engine
        decodes with (read them, don't change them), and its result; blocks until done. Torch
        work of the process stays on the one compute thread (e.g. `forward` to score a prompt)."""
        return self._ask(Call(fn)).result

    def stats(self) -> EngineStats:
        """Running and waiting requests, pages, prefix-cache hit rate, tokens/s and totals, as
        of the last snapshot (taken between steps, see EngineConfig.stats_interval_ms)."""
        return self._snapshot

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

    def _ask(self, message: SwapParams | Call) -> SwapParams | Call:
        """Send a message the thread answers, and wait for the answer."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        self._inbox.put(message)
        message.done.wait()
        if message.error is not None:
            raise message.error
        return message

    def _prepare(self, params):
        prepared = prepare_params(params_for(self.config, params), self.config.quantize)
        self.kernels = kernels_used(prepared)  # which product each matrix runs, for the logs
        return prepared

    def _sequence(self, prompt, sampling: Sampling, fields: dict) -> Sequence:
        if self._closed:
            raise RuntimeError("the engine is closed")
        sp = with_fields(sampling, fields)
        request_id = f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}"
        return new_sequence(self.cfg, self.config, self.tokenizer, Request(request_id, prompt, sp))

    def _send(self, seqs: list[Sequence], sink: Sink) -> None:
        with self._lock:
            check_room(self._queued + self._waiting, self.config.max_waiting)
            self._queued += len(seqs)
        self._inbox.put(Submit(seqs, sink))

    # ------------------------------------------------------------------ engine thread

    def _run(self, params, config, settings, started: Started) -> None:
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

    def _handle_messages(self) -> bool | None:
        """Take every message waiting (block for one when idle). Returns whether there were
        any, or None once closed."""
        block, had_messages = not has_work(self._state), False
        while True:
            try:
                message = self._inbox.get(block=block)
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

    def _enqueue(self, seqs: list[Sequence], sink: Sink) -> None:
        for seq in seqs:
            self._sinks[seq.id] = sink
            self._pending[seq.id] = Pending(sink.loop)
            self._state = enqueue(self._state, seq)
        with self._lock:
            self._queued -= len(seqs)
            self._waiting = len(self._state.sched.waiting)

    def _step(self, had_messages: bool) -> None:
        events: list[StreamEvent] = []
        busy = has_work(self._state)
        started, steps = time.monotonic(), self._state.totals.steps
        if busy:
            try:
                self._state, events = engine_step(self._state, self._params, self._step_seconds)
            except Exception as exc:  # never let the thread die with callers waiting
                self._state = end_all(self._state, "error", describe(exc))
                self._state, events = engine_step(self._state, self._params)
            self._waiting = len(self._state.sched.waiting)  # one int: read without the lock
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
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            match message:
                case Submit(seqs, sink):
                    self._enqueue(seqs, sink)
                case SwapParams(_, done) | Call(_, done):
                    message.error = RuntimeError("the engine is closed")
                    done.set()
        self._state = end_all(self._state, "abort")
        self._state, events = engine_step(self._state, self._params)
        self._take_snapshot(time.monotonic())
        self._deliver(events, time.monotonic())

    def _take_snapshot(self, now: float) -> None:
        stats = engine_stats(self._state)
        self._snapshot_at = now
        self._snapshot = msgspec.structs.replace(
            stats,
            waiting=stats.waiting + self._queued,
            tokens_per_s=tokens_per_s(self._recent, now),
            uptime_s=now - self._started_at,
        )
