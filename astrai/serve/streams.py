"""Engine streams for one HTTP request: submitted, read together, measured, collected.

A request with n choices submits n engine requests of the same prompt (they share the prompt's
pages through the prefix cache). Submission happens before any HTTP header is sent, so a
refused request (prompt too long, overloaded) is still an HTTP error. Closing `Choices`
cancels every engine request that has not finished, which frees its pages: the app closes it
after every response, also when the client went away mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from asyncio import ensure_future
from typing import Any

import anyio

from astrai.infer import Completion, Overloaded, PromptTooLong, UnknownAdapter
from astrai.infer.events import add_event
from astrai.serve.engine_requests import EngineRequest
from astrai.serve.errors import APIError, bad_request, generation_failed, overloaded
from astrai.serve.metrics import Metrics, count_usage, observe

Event = Any  # astrai.infer.StreamEvent
log = logging.getLogger("astrai.serve")


class Choices:
    """The engine streams of one request's choices, read hand-over by hand-over: each read
    returns the (index, event) pairs the engine handed over together (all of one stream's
    events already at hand; several streams' when their events arrived at once), with latency
    and usage recorded in `metrics` on the way. Nothing waits to fill a hand-over: what the
    engine sends together is read together, so a writer can send it in one write.

    `request_id` is the HTTP request's id; `streams` maps choice index -> engine stream;
    `firsts` holds events already read. From here to `aclose` the request is listed in
    `metrics.open_requests`; `aclose` logs one line about it."""

    def __init__(
        self, request_id: str, streams: dict, firsts: dict, metrics: Metrics, since: float
    ):
        self.request_id, self.streams = request_id, streams
        self.metrics, self.since = metrics, since
        metrics.open_requests[request_id] = since
        self.finished: dict[int, Event] = {}
        # One choice is read straight from its stream: a task and a wait per hand-over would
        # cost the event loop more than the rest of the tokens' way to the socket.
        self.single = next(iter(streams.items())) if len(streams) == 1 else None
        self.pending = (
            {} if self.single else {ensure_future(anext(s)): i for i, s in streams.items()}
        )
        self.firsts: list[tuple[int, Event]] = sorted(firsts.items())
        self.last_token: dict[int, float] = {}

    def __aiter__(self) -> Choices:
        return self

    async def __anext__(self) -> list[tuple[int, Event]]:
        if self.firsts:
            handover, self.firsts = self.firsts, []
        elif self.single:
            i, stream = self.single
            handover = [(i, e) for e in await _with_rest_at_hand(stream, await anext(stream))]
        else:
            handover = await self._from_any()
        for i, event in handover:
            self._measure(i, event)
        return handover

    async def _from_any(self) -> list[tuple[int, Event]]:
        handover = []
        while not handover:
            if not self.pending:
                raise StopAsyncIteration
            done, _ = await asyncio.wait(self.pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=self.pending.get):
                i = self.pending.pop(task)
                with contextlib.suppress(StopAsyncIteration):
                    events = await _with_rest_at_hand(self.streams[i], task.result())
                    handover += [(i, e) for e in events]
                    if events[-1].finish_reason is None:
                        self.pending[ensure_future(anext(self.streams[i]))] = i
        return handover

    def _measure(self, i: int, event: Event) -> None:
        t, n, m = time.monotonic(), len(event.token_ids or ()), self.metrics
        if n and i in self.last_token:
            observe(m.inter_token_latency, (t - self.last_token[i]) / n, n)
        elif n:
            observe(m.time_to_first_token, t - self.since)
        if n:
            self.last_token[i] = t
        if event.finish_reason is not None:
            self.finished[i] = event
            observe(m.request_latency, t - self.since)
            if event.usage is not None:
                u = event.usage
                count_usage(m, u.prompt_tokens, u.cached_tokens, u.completion_tokens)

    async def aclose(self) -> None:
        """Cancel what is unfinished; safe to call more than once, also while being cancelled."""
        with anyio.CancelScope(shield=True):
            for task in self.pending:
                task.cancel()
            # a stream cannot be closed while a task is still inside it
            await asyncio.gather(*self.pending, return_exceptions=True)
            self.pending = {}
            for stream in self.streams.values():
                await stream.aclose()
            if self.metrics.open_requests.pop(self.request_id, None) is not None:
                log.info(request_line(self.request_id, self.streams, self.finished, self.since))


def request_line(request_id: str, streams: dict, finished: dict, since: float) -> str:
    """What the log says about a request once it is closed: how each choice ended (a choice
    closed before its end was cancelled), its tokens over all choices (choices of one prompt
    read theirs from the prefix cache) and its time."""
    ends = [finished[i].finish_reason if i in finished else "cancelled" for i in sorted(streams)]
    usages = [finished[i].usage for i in sorted(finished) if finished[i].usage is not None]
    prompt = sum(u.prompt_tokens for u in usages)
    cached = sum(u.cached_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    return (
        f"{request_id}: {len(streams)} choice(s) {','.join(ends)}, {prompt} prompt tokens "
        f"({cached} cached), {generated} generated, {time.monotonic() - since:.3f} s"
    )


async def _with_rest_at_hand(stream, event: Event) -> list[Event]:
    """`event` and the events of `stream` already at hand after it (read without waiting)."""
    events = [event]
    while events[-1].finish_reason is None and stream.at_hand():
        events.append(await anext(stream))
    return events


async def _started(request_id, streams: dict, firsts: dict, metrics, since: float) -> Choices:
    choices = Choices(request_id, streams, firsts, metrics, since)
    # One turn of the loop lets every stream reach its first wait; from then on closing a
    # stream cancels its engine request (a stream closed before it started would not).
    await asyncio.sleep(0)
    return choices


def _refusal(exc: BaseException) -> BaseException:
    """The engine's refusals as the HTTP errors they are."""
    if isinstance(exc, UnknownAdapter):  # unloaded since the request's model was checked
        return APIError(404, str(exc), "model", "model_not_found")
    if isinstance(exc, PromptTooLong):
        return bad_request(str(exc), "max_tokens", "context_length_exceeded")
    if isinstance(exc, Overloaded):
        return overloaded(str(exc))
    if isinstance(exc, ValueError):  # anything else the engine refuses to take
        return bad_request(str(exc))
    return exc


def engine_ids(request_id: str, n: int) -> list[str]:
    """The engine's names for the choices of HTTP request `request_id`: the id itself for one
    choice, `<id>-<k>` for choice k of several."""
    return [request_id] if n == 1 else [f"{request_id}-{k}" for k in range(n)]


def _submit(engine, request_id: str, request: EngineRequest):
    return engine.astream(
        request.prompt, request.sampling, request_id=request_id, adapter=request.adapter
    )


async def open_choices(
    engine, request_id: str, requests: list[EngineRequest], metrics: Metrics
) -> Choices:
    """Submit the engine requests of HTTP request `request_id`, one per choice, named after it
    (see engine_ids), so that one id follows the request through the server and the engine.

    Choices that repeat a prompt are submitted once its first request has produced a token:
    by then its prompt is prefilled and in the prefix cache, so they share its pages instead
    of each computing them again."""
    since, streams, firsts = time.monotonic(), {}, {}
    leaders: dict[tuple[int, ...], int] = {}
    for i, request in enumerate(requests):
        leaders.setdefault(tuple(request.prompt), i)
    followers = [i for i in range(len(requests)) if i not in leaders.values()]
    ids = engine_ids(request_id, len(requests))
    try:
        for i in leaders.values():
            streams[i] = _submit(engine, ids[i], requests[i])
        if followers:
            for i in list(streams):
                firsts[i] = await anext(streams[i])
            for i in followers:
                streams[i] = _submit(engine, ids[i], requests[i])
    except BaseException as exc:
        await (await _started(request_id, streams, {}, metrics, since)).aclose()
        raise _refusal(exc) from None
    return await _started(request_id, streams, firsts, metrics, since)


async def collect(choices: Choices, n: int) -> list[Completion]:
    """Each choice's events joined into its Completion; a choice that failed fails them all."""
    outcomes = [Completion() for _ in range(n)]
    async with contextlib.aclosing(choices):
        async for handover in choices:
            for i, event in handover:
                add_event(outcomes[i], event)
    for outcome in outcomes:
        if outcome.finish_reason == "error":
            raise generation_failed(outcome.error)
    return outcomes
