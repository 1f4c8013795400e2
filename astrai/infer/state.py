"""The engine state and the functions that change it between steps: requests join
(`add_request`) and leave (`cancel_request`, `end_all`), the weights change
(`forget_cached_kv`). Each takes the state and returns it, donated: the caller goes on with
the state that comes back, and using the one it gave raises DonatedError."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astrai.config import EngineConfig, ModelConfig
from astrai.infer.donation import donates
from astrai.infer.events import StreamEvent, Usage
from astrai.infer.pages import init_pages
from astrai.infer.requests import Request, new_sequence
from astrai.infer.resolve import engine_settings
from astrai.infer.scheduler import (
    Scheduler,
    add_sequence,
    drop_prefix_cache,
    finish_sequence,
    init_scheduler,
)
from astrai.infer.sequence import Sequence
from astrai.infer.speculate_step import Speculator, forget, init_speculator
from astrai.model import DTYPES


@dataclass(eq=False)
class Totals:
    steps: int = 0
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    completion_tokens: int = 0
    requests_added: int = 0  # numbers the generators of requests given no seed
    spec_steps: int = 0  # speculative rows verified (see EngineStats)
    spec_proposed: int = 0
    spec_accepted: int = 0


@dataclass(eq=False)
class EngineState:
    """Everything the engine knows between two steps. `engine_config` has every size resolved
    (num_pages, max_seq_len, dtype); `sched` holds the pool, the prefix cache and the
    sequences; `final_events` holds the final events of requests ended between steps, which
    the next step hands back."""

    model_config: ModelConfig
    tokenizer: object | None
    engine_config: EngineConfig
    sched: Scheduler
    final_events: list[StreamEvent]
    totals: Totals
    spec: Speculator | None = None  # speculative decoding's state (EngineConfig.speculative)
    donated_to: str | None = None  # the function this object was handed to (see donation.py)


def init_engine(
    params,
    cfg: ModelConfig,
    tokenizer=None,
    config: EngineConfig | None = None,
    **settings,
) -> EngineState:
    """An idle engine: an empty page pool and prefix cache, no requests. Settings are the
    fields of EngineConfig, given as `config` and/or keyword arguments (which win). params
    only tell the default dtype; `engine_step` takes the weights to run each time. With
    speculative = "draft", the draft model is read from `draft_model` here."""
    config = engine_settings(cfg, params, config, settings)
    pool = init_pages(
        cfg, config.num_pages, config.page_size, DTYPES[config.dtype], torch.device(config.device)
    )
    sched = init_scheduler(pool, config, cfg.attention_window)
    spec = init_speculator(config, cfg)
    return EngineState(cfg, tokenizer, config, sched, [], Totals(), spec)


def request_seed(engine_seed: int, n: int) -> int:
    """The seed of the n-th request without one that joins an engine seeded `engine_seed`:
    a 63-bit mix of the two (splitmix64), so neighbouring requests draw unrelated streams."""
    z = (engine_seed * 0x9E3779B97F4A7C15 + (n + 1) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (z ^ (z >> 31)) >> 1


@donates
def enqueue(state: EngineState, seq: Sequence) -> EngineState:
    """A checked sequence (see requests.new_sequence) joins at the end of the queue. One
    without a generator (its request gave no seed) gets one from the engine's seed and the
    count of requests so far, so one state and one set of weights give the same events."""
    if seq.generator is None:
        seed = request_seed(state.engine_config.seed, state.totals.requests_added)
        seq.generator = torch.Generator().manual_seed(seed)
    state.totals.requests_added += 1
    state.sched = add_sequence(state.sched, seq)
    return state


@donates
def add_request(state: EngineState, request: Request) -> EngineState:
    """The request joins the queue; it is admitted at a step when a place and pages are free.
    Raises PromptTooLong or ValueError for a request the engine cannot serve."""
    seq = new_sequence(state.model_config, state.engine_config, state.tokenizer, request)
    return enqueue(state, seq)


def live_sequences(state: EngineState) -> list[Sequence]:
    return [*state.sched.running, *state.sched.waiting]


def has_work(state: EngineState) -> bool:
    """Whether `engine_step` has anything to do or to hand back."""
    return bool(state.sched.running or state.sched.waiting or state.final_events)


def retire(
    state: EngineState,
    seq: Sequence,
    reason: str,
    event: StreamEvent | None = None,
    stop_text: str | None = None,
    error: str | None = None,
) -> tuple[EngineState, StreamEvent]:
    """End seq: free (and offer to the prefix cache) its pages; returns its final event."""
    state.sched = finish_sequence(state.sched, seq, cache=reason != "error")
    if state.spec is not None:
        state.spec = forget(state.spec, seq.id)
    t = state.totals
    match reason:
        case "abort":
            t.aborted += 1
        case "error":
            t.errors += 1
        case _:
            t.finished += 1
    usage = Usage(
        prompt_tokens=seq.prompt_len,
        cached_tokens=max(seq.cached_tokens, 0),
        completion_tokens=seq.generated,
    )
    event = event or StreamEvent(request_id=seq.id)
    event.finish_reason, event.usage = reason, usage
    event.stop_reason_text, event.error = stop_text, error
    return state, event


@donates
def cancel_request(state: EngineState, request_id: str) -> EngineState:
    """Stop a request (a no-op for one that is not there): its pages are freed now, and its
    final event, finish_reason "abort", comes out of the next `engine_step`."""
    for seq in live_sequences(state):
        if seq.id == request_id:
            state, event = retire(state, seq, "abort")
            state.final_events.append(event)
    return state


@donates
def end_all(state: EngineState, reason: str, error: str | None = None) -> EngineState:
    """End every request with `reason` ("abort" or "error"); their final events come out of
    the next `engine_step`."""
    for seq in live_sequences(state):
        state, event = retire(state, seq, reason, error=error)
        state.final_events.append(event)
    return state


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@donates
def forget_cached_kv(state: EngineState) -> EngineState:
    """Call after changing the weights: the prefix cache is dropped, and the K/V of running
    requests (computed with the old weights) is never cached."""
    state.sched = drop_prefix_cache(state.sched)
    return state
