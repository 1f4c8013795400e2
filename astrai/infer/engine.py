"""Engine: the one stateful object of inference. A background thread runs continuous batching
over the pure pieces (scheduler, prefill, decode_step, sample) and streams events to callers.

Callers on any thread submit requests and read events; only the engine thread touches the
pool, the scheduler and the sequences, so none of them need locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import queue
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import torch

from astrai.config import ModelConfig
from astrai.infer.events import Completion, Overloaded, PromptTooLong, StreamEvent, Usage, collect
from astrai.infer.paged import decode_step, prefill, prepare_params
from astrai.infer.pages import init_pages, num_free_pages
from astrai.infer.radix import clear_prefix_cache, num_cached_pages
from astrai.infer.sampling import SamplingParams, sample_requests, sampling_params
from astrai.infer.scheduler import (
    Sequence,
    StepPlan,
    add_sequence,
    advance,
    finish_sequence,
    init_scheduler,
    pages_for,
    plan_step,
)
from astrai.infer.stops import scan_stops
from astrai.model import kv_shapes


@dataclass(eq=False)
class Request:
    """Per-request state the engine thread keeps next to the scheduler's Sequence."""

    id: str
    sampling: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    sink: Callable[[StreamEvent], None]
    decoder: object | None  # the tokenizer's stream decoder
    max_len: int  # prompt + max_tokens
    held: str = ""  # decoded text not yet emitted (could start a stop string)
    generated: int = 0


@dataclass
class EngineStats:
    started: float = field(default_factory=time.monotonic)
    steps: int = 0
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    completion_tokens: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=256))  # (time, tokens)


def default_num_pages(cfg, max_batch, table_width, page_size, dtype) -> int:
    """Room for max_batch full-length sequences, capped at 1 GiB of K/V (but never less than
    one full-length sequence)."""
    k_shape, v_shape = kv_shapes(cfg)
    per_token = cfg.num_hidden_layers * (math.prod(k_shape) + math.prod(v_shape))
    page_bytes = per_token * page_size * torch.empty((), dtype=dtype).element_size()
    return max(table_width, min(max_batch * table_width, (1 << 30) // page_bytes))


class Engine:
    """Continuous-batching generation over a model, on a background thread.

    engine.generate(prompts, **sampling) blocks for a batch; submit/result, stream and astream
    serve one request each. Sampling keyword arguments are the fields of SamplingParams.
    """

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        cfg: ModelConfig,
        tokenizer,
        *,
        num_pages: int | None = None,
        page_size: int = 16,
        max_batch: int = 64,
        max_seq_len: int | None = None,
        prefill_chunk: int = 512,
        max_waiting: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        prefix_cache: bool = True,
    ):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.device = torch.device(device)
        self.dtype = dtype or next(iter(params.values())).dtype
        self.max_seq_len = max_seq_len or cfg.max_position_embeddings
        self.max_waiting = max_waiting
        self.page_size = page_size
        self.table_width = pages_for(self.max_seq_len, page_size)
        if num_pages is None:
            num_pages = default_num_pages(cfg, max_batch, self.table_width, page_size, self.dtype)
        self.num_pages = num_pages
        self._params = self._prepare(params)
        pool = init_pages(cfg, num_pages, page_size, self.dtype, self.device)
        self._sched = init_scheduler(pool, page_size, max_batch, prefill_chunk, prefix_cache)
        self._inbox: queue.Queue = queue.Queue()
        self._queued = 0  # submissions not yet seen by the engine thread
        self._lock = threading.Lock()
        self._results: dict[str, queue.SimpleQueue] = {}
        self._counter = itertools.count()
        self._stats = EngineStats()
        self._snapshot: dict = {}
        self._finals: list[tuple[Request, StreamEvent]] = []  # final events not yet sent
        self._closed = False
        self._refresh_snapshot()
        self._thread = threading.Thread(target=self._run, name="astrai-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    def generate(self, prompts: list[str | list[int]], **sampling) -> list[Completion]:
        """Generate for every prompt, batched; blocks until all are done."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise TypeError("generate takes a list of prompts; use submit or stream for one")
        events: queue.SimpleQueue = queue.SimpleQueue()
        requests = [self._make_request(p, sampling, events.put) for p in prompts]
        self._check_waiting()
        for request, seq in requests:
            self._enqueue(request, seq, check_waiting=False)
        by_id: dict[str, list[StreamEvent]] = {r.id: [] for r, _ in requests}
        remaining = len(requests)
        while remaining:
            event = events.get()
            by_id[event.request_id].append(event)
            remaining -= event.finish_reason is not None
        return [collect(by_id[r.id]) for r, _ in requests]

    def submit(self, prompt: str | list[int], **sampling) -> str:
        """Queue one request and return its id at once; `result(id)` waits for it."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        request, seq = self._make_request(prompt, sampling, events.put)
        self._results[request.id] = events
        self._enqueue(request, seq)
        return request.id

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

    def stream(self, prompt: str | list[int], **sampling) -> Iterator[StreamEvent]:
        """Submit now; iterate the request's events. Leaving the loop early cancels it."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        request, seq = self._make_request(prompt, sampling, events.put)
        self._enqueue(request, seq)
        return self._iterate(request.id, events)

    def _iterate(self, request_id: str, events: queue.SimpleQueue) -> Iterator[StreamEvent]:
        done = False
        try:
            while not done:
                event = events.get()
                done = event.finish_reason is not None
                yield event
        finally:
            if not done:
                self.cancel(request_id)

    def astream(self, prompt: str | list[int], **sampling) -> AsyncIterator[StreamEvent]:
        """stream() for an asyncio event loop: call it inside the loop. Closing the iterator or
        cancelling the task that reads it cancels the request and frees its pages."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(event: StreamEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        request, seq = self._make_request(prompt, sampling, put)
        self._enqueue(request, seq)
        return self._aiterate(request.id, events)

    async def _aiterate(self, request_id: str, events: asyncio.Queue):
        done = False
        try:
            while not done:
                event = await events.get()
                done = event.finish_reason is not None
                yield event
        finally:
            if not done:
                self.cancel(request_id)

    def cancel(self, request_id: str) -> None:
        """Stop a request; it finishes with finish_reason "abort" and its pages are freed."""
        self._inbox.put(("cancel", request_id))

    def update_params(self, params: dict[str, torch.Tensor]) -> None:
        """Swap the weights between two steps (e.g. after an RL update) and clear the prefix
        cache. Running requests go on with the new weights. Blocks until the swap is done."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        done = threading.Event()
        self._inbox.put(("params", (params, done)))
        done.wait()

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
            self._inbox.put(("close", None))
        self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ caller side

    def _prepare(self, params):
        params = {k: v.to(device=self.device, dtype=self.dtype) for k, v in params.items()}
        return prepare_params(params, self.cfg)

    def _make_request(self, prompt, sampling: dict, sink) -> tuple[Request, Sequence]:
        if self._closed:
            raise RuntimeError("the engine is closed")
        sp = sampling if isinstance(sampling, SamplingParams) else sampling_params(**sampling)
        tokens = self._tokenize(prompt)
        max_len = len(tokens) + sp.max_tokens
        if max_len > self.max_seq_len:
            raise PromptTooLong(
                f"prompt ({len(tokens)} tokens) + max_tokens ({sp.max_tokens}) = {max_len} "
                f"exceeds max_seq_len ({self.max_seq_len})"
            )
        # the last generated token is never fed back, so it needs no K/V
        if pages_for(max_len - 1, self.page_size) > self.num_pages:
            raise PromptTooLong(
                f"prompt + max_tokens = {max_len} tokens do not fit the page pool "
                f"({self.num_pages} pages of {self.page_size})"
            )
        if sp.logit_bias and not all(0 <= t < self.cfg.vocab_size for t in sp.logit_bias):
            raise ValueError(f"logit_bias token ids must be in [0, {self.cfg.vocab_size})")
        if sp.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        stop_ids = frozenset(sp.stop_token_ids)
        if not sp.ignore_eos and self.tokenizer is not None:
            stop_ids |= self.tokenizer.stop_ids
        seed = sp.seed if sp.seed is not None else random.getrandbits(63)
        request = Request(
            id=f"req-{next(self._counter)}-{uuid.uuid4().hex[:8]}",
            sampling=sp,
            stop_ids=stop_ids,
            generator=torch.Generator().manual_seed(seed),
            sink=sink,
            decoder=self.tokenizer.stream_decoder() if self.tokenizer is not None else None,
            max_len=max_len,
        )
        seq = Sequence(id=request.id, tokens=tokens, prompt_len=len(tokens), data=request)
        return request, seq

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids")
            tokens = self.tokenizer.encode(prompt)
        else:
            tokens = [int(t) for t in prompt]
            bad = [t for t in tokens if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise ValueError(f"token ids out of range [0, {self.cfg.vocab_size}): {bad[:5]}")
        if not tokens:
            raise ValueError("the prompt is empty")
        return tokens

    def _check_waiting(self) -> None:
        waiting = self._queued + len(self._sched.waiting)
        if self.max_waiting is not None and waiting >= self.max_waiting:
            raise Overloaded(f"{waiting} requests are already waiting (max_waiting)")

    def _enqueue(self, request: Request, seq: Sequence, check_waiting: bool = True) -> None:
        with self._lock:
            if check_waiting:
                self._check_waiting()
            self._queued += 1
        self._inbox.put(("submit", seq))

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        with torch.inference_mode():
            self._loop()

    def _loop(self) -> None:
        while True:
            idle = not (self._sched.running or self._sched.waiting)
            try:
                message = self._inbox.get(block=idle)
            except queue.Empty:
                message = None
            news = message is not None
            while message is not None:
                try:
                    if not self._handle(*message):
                        return
                except Exception as exc:  # a bad message must not stop the engine
                    self._fail_message(message, exc)
                try:
                    message = self._inbox.get_nowait()
                except queue.Empty:
                    message = None
            if self._sched.running or self._sched.waiting:
                try:
                    self._step()
                except Exception as exc:  # never let the thread die with callers waiting
                    for seq in [*self._sched.running, *self._sched.waiting]:
                        self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
            busy = self._sched.running or self._sched.waiting
            # while busy, at most 20 snapshots a second (counting pages is not free), and one
            # after new messages, so a snapshot never predates a request it does not show
            if news or self._finals or not busy or time.monotonic() - self._snapshot["at"] > 0.05:
                self._refresh_snapshot()
            self._emit_finals()

    def _handle(self, kind: str, payload) -> bool:
        match kind:
            case "submit":
                with self._lock:
                    self._queued -= 1
                add_sequence(self._sched, payload)
            case "cancel":
                seq = self._find(payload)
                if seq is not None:
                    self._finish(seq, "abort")
            case "params":
                params, done = payload
                self._params = self._prepare(params)
                s = self._sched
                if s.cache is not None:
                    s.pool = clear_prefix_cache(s.cache, s.pool)
                for seq in [*s.running, *s.waiting]:  # their K/V came from the old weights
                    seq.cacheable = False
                self._refresh_snapshot()
                done.set()
            case "close":
                for seq in [*self._sched.running, *self._sched.waiting]:
                    self._finish(seq, "abort")
                while True:  # submissions that raced with close
                    try:
                        kind, payload = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if kind == "submit":
                        self._finish(payload, "abort")
                    elif kind == "params":
                        payload[1].set()
                self._refresh_snapshot()
                self._emit_finals()
                return False
        return True

    def _fail_message(self, message, exc: Exception) -> None:
        kind, payload = message
        if kind == "submit":
            self._finish(payload, "error", error=f"{type(exc).__name__}: {exc}")
        elif kind == "params":
            payload[1].set()

    def _find(self, request_id: str) -> Sequence | None:
        for seq in [*self._sched.running, *self._sched.waiting]:
            if seq.id == request_id:
                return seq
        return None

    def _step(self) -> None:
        plan = plan_step(self._sched)  # a failure here fails every request (see _loop)
        if not plan.decode and not plan.prefill:
            return
        try:
            rows, logits = self._forward(plan)
            sampled = self._sample(rows, logits) if rows else []
        except Exception as exc:
            for seq in [*plan.decode, *(seq for seq, _ in plan.prefill)]:
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")
            return
        self._stats.steps += 1
        self._stats.recent.append((time.monotonic(), len(rows)))
        for seq, (token, logprob) in zip(rows, sampled):
            try:
                self._advance(seq, token, logprob)
            except Exception as exc:
                self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}")

    def _page_table(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(seq.pages) for seq in seqs)
        return torch.tensor([seq.pages + [0] * (width - len(seq.pages)) for seq in seqs])

    def _forward(self, plan: StepPlan) -> tuple[list[Sequence], torch.Tensor | None]:
        """Run the model for the step; returns the sequences to sample and their logits."""
        s, device = self._sched, self.device
        rows, logits = [], []
        if plan.decode:
            tokens = torch.tensor([seq.tokens[-1] for seq in plan.decode], device=device)
            positions = torch.tensor([seq.computed for seq in plan.decode], device=device)
            table = self._page_table(plan.decode)
            out, s.pool = decode_step(self._params, self.cfg, s.pool, tokens, positions, table)
            rows += plan.decode
            logits.append(out)
        if plan.prefill:
            width = max(n for _, n in plan.prefill)
            chunks = [seq.tokens[seq.computed : seq.computed + n] for seq, n in plan.prefill]
            tokens = torch.tensor([c + [0] * (width - len(c)) for c in chunks], device=device)
            start = torch.tensor([seq.computed for seq, _ in plan.prefill], device=device)
            lengths = torch.tensor([n for _, n in plan.prefill], device=device)
            table = self._page_table([seq for seq, _ in plan.prefill])
            out, s.pool = prefill(self._params, self.cfg, s.pool, tokens, table, start, lengths)
            done = [i for i, (seq, n) in enumerate(plan.prefill) if seq.pending == n]
            rows += [plan.prefill[i][0] for i in done]
            logits.append(out[done])
        advance(s, plan)
        return rows, torch.cat(logits) if rows else None

    def _sample(self, rows: list[Sequence], logits: torch.Tensor):
        requests = [seq.data for seq in rows]
        return sample_requests(
            logits,
            [r.sampling for r in requests],
            [r.generator for r in requests],
            [seq.tokens for seq in rows],
        )

    def _advance(self, seq: Sequence, token: int, logprob: dict | None) -> None:
        """Take one sampled token: detokenize, check the stop conditions, emit an event."""
        request: Request = seq.data
        seq.tokens.append(token)
        request.generated += 1
        self._stats.completion_tokens += 1
        finish, matched, text = None, None, ""
        if token in request.stop_ids:
            finish = "stop"
            if self.tokenizer is not None:
                matched = self.tokenizer.decode([token], skip_special_tokens=False)
        elif request.decoder is not None:
            request.held += request.decoder.push(token)
            text, request.held, hit = scan_stops(request.held, request.sampling.stop)
            if hit is not None:
                finish, matched = "stop", hit
        if finish is None and len(seq.tokens) >= request.max_len:
            finish = "length"
        if finish == "length" or token in request.stop_ids:
            text += self._flush(request)
        event = StreamEvent(
            request_id=seq.id,
            text=text,
            token_ids=[token],
            logprobs=[logprob] if logprob is not None else None,
        )
        if finish is None:
            self._emit(request, event)
        else:
            self._finish(seq, finish, event=event, stop_text=matched)

    def _flush(self, request: Request) -> str:
        """No more tokens will come: release the held text and the decoder's last bytes, cut
        at a stop string should those bytes complete one."""
        if request.decoder is None:
            return ""
        held = request.held + request.decoder.flush()
        request.held = ""
        text, rest, hit = scan_stops(held, request.sampling.stop)
        return text if hit is not None else text + rest

    def _emit(self, request: Request, event: StreamEvent) -> None:
        # a reader that went away (e.g. a closed event loop) must not stop the engine
        with contextlib.suppress(Exception):
            request.sink(event)

    def _finish(
        self,
        seq: Sequence,
        reason: str,
        event: StreamEvent | None = None,
        stop_text: str | None = None,
        error: str | None = None,
    ) -> None:
        """Retire a sequence and send its final event (with usage)."""
        request: Request = seq.data
        finish_sequence(self._sched, seq, cache=reason != "error")
        if reason == "abort":
            self._stats.aborted += 1
        elif reason == "error":
            self._stats.errors += 1
        else:
            self._stats.finished += 1
        usage = Usage(
            prompt_tokens=seq.prompt_len,
            cached_tokens=max(seq.cached_tokens, 0),
            completion_tokens=request.generated,
        )
        event = event or StreamEvent(request_id=seq.id)
        event.finish_reason, event.usage = reason, usage
        event.stop_reason_text, event.error = stop_text, error
        self._finals.append((request, event))

    def _emit_finals(self) -> None:
        """Send the final events of finished requests, after the snapshot that counts them, so
        a caller who has its result never reads stats from before."""
        finals, self._finals = self._finals, []
        for request, event in finals:
            self._emit(request, event)

    def _refresh_snapshot(self) -> None:
        s, st = self._sched, self._stats
        now = time.monotonic()
        window = [(t, n) for t, n in st.recent if now - t <= 10.0]
        span = now - window[0][0] if len(window) > 1 else 0.0
        rate = sum(n for _, n in window[1:]) / span if span > 0 else 0.0
        free = num_free_pages(s.pool)
        cached = num_cached_pages(s.cache) if s.cache is not None else 0
        evictable = 0
        if cached:
            pages = torch.tensor(list(s.cache.nodes), dtype=torch.long)
            evictable = int((s.pool["refs"][pages] == 1).sum())
        self._snapshot = {
            "at": now,
            "running": len(s.running),
            "waiting": len(s.waiting) + self._queued,
            "pages_total": self.num_pages,
            "pages_free": free,
            "pages_cached": cached,
            "pages_used": self.num_pages - free - evictable,  # held by requests
            "prefix_cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
            "tokens_per_s": rate,
            "steps": st.steps,
            "preemptions": s.preemptions,
            "requests_finished": st.finished,
            "requests_aborted": st.aborted,
            "requests_failed": st.errors,
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.cached_tokens,
            "completion_tokens": st.completion_tokens,
            "uptime_s": now - st.started,
        }
