"""Continuous batching as pure functions over one engine state, no thread involved:

    state = init_engine(params, cfg, tokenizer, max_batch=8)
    state = add_request(state, Request("a", "Hello", SamplingParams(max_tokens=16)))
    state, events = engine_step(state, params)     # every request moves one step

`engine_step` plans the step (admission, pages, preemption), runs chunked prefill and one
decode token for the running sequences (or, when every one of them decodes greedily, a run of
a few decode steps), samples, detokenizes, applies the stop conditions and returns one
StreamEvent per token produced or request finished. Requests join (`add_request`) and leave
(`cancel_request`) between steps. Nothing here reads a clock or waits: the same state and
weights give the same events.

The state is donated to every function that takes it, JAX-style: the page pool and the
sequences are updated in place, and the caller goes on with the state that comes back.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

import msgspec
import torch

from astrai.config import EngineConfig, ModelConfig, engine_config, from_dict, to_dict
from astrai.infer.constraints import accept_token, allowed_tokens, is_finished, start_constraint
from astrai.infer.events import Completion, PromptTooLong, StreamEvent, Usage, collect
from astrai.infer.hardware import auto_dtype, describe_dtype_choice
from astrai.infer.paged import decode_step, prefill
from astrai.infer.pages import init_pages, num_free_pages, pages_for
from astrai.infer.radix import num_cached_pages, num_evictable_pages
from astrai.infer.sampling import SamplingParams, sample_ids, sample_requests
from astrai.infer.scheduler import (
    Scheduler,
    StepPlan,
    add_sequence,
    advance,
    decode_run_length,
    drop_prefix_cache,
    fed,
    finish_sequence,
    init_scheduler,
    plan_step,
    reserve_run,
)
from astrai.infer.sequence import Sequence
from astrai.infer.stops import scan_stops
from astrai.model import DTYPES, kv_shapes

Params = dict[str, torch.Tensor]
log = logging.getLogger("astrai.infer")


class Request(msgspec.Struct, frozen=True):
    """What a caller asks for: a prompt (text, or token ids) and how to sample it. The id names
    the request in the events; it must differ from those of the requests still running."""

    id: str
    prompt: str | list[int]
    sampling: SamplingParams = SamplingParams()


@dataclass(eq=False)
class Totals:
    steps: int = 0
    finished: int = 0
    aborted: int = 0
    errors: int = 0
    completion_tokens: int = 0


@dataclass(eq=False)
class EngineState:
    """Everything the engine knows between two steps. `config` has every size resolved
    (num_pages, max_seq_len, dtype); `sched` holds the pool, the prefix cache and the
    sequences; `outbox` holds the final events of requests retired between steps."""

    cfg: ModelConfig
    tokenizer: object | None
    config: EngineConfig
    sched: Scheduler
    outbox: list[StreamEvent]
    totals: Totals


def default_num_pages(cfg: ModelConfig, config: EngineConfig, width: int, dtype) -> int:
    """Room for max_batch full-length sequences, capped at max_pool_bytes of K/V (but never
    less than one full-length sequence)."""
    k_shape, v_shape = kv_shapes(cfg)
    per_token = cfg.num_hidden_layers * (math.prod(k_shape) + math.prod(v_shape))
    page_bytes = per_token * config.page_size * torch.empty((), dtype=dtype).element_size()
    return max(width, min(config.max_batch * width, config.max_pool_bytes // page_bytes))


def resolve_config(cfg: ModelConfig, config: EngineConfig, params: Params) -> EngineConfig:
    """config with its None sizes filled in: dtype from the weights ("auto" from the hardware,
    see astrai.infer.hardware), max_seq_len from the model, num_pages from the memory rule
    above."""
    dtype = config.dtype or str(next(iter(params.values())).dtype).removeprefix("torch.")
    if dtype == "auto":
        dtype = auto_dtype(config.device)
        log.info(describe_dtype_choice(config.device))
    max_seq_len = config.max_seq_len or cfg.max_position_embeddings
    num_pages = config.num_pages or default_num_pages(
        cfg, config, pages_for(max_seq_len, config.page_size), DTYPES[dtype]
    )
    return msgspec.structs.replace(
        config, dtype=dtype, max_seq_len=max_seq_len, num_pages=num_pages
    )


def init_engine(
    params: Params,
    cfg: ModelConfig,
    tokenizer=None,
    config: EngineConfig | None = None,
    **settings,
) -> EngineState:
    """An idle engine: an empty page pool and prefix cache, no requests. Settings are the
    fields of EngineConfig, given as `config` and/or keyword arguments (which win). params
    only tell the default dtype; `engine_step` takes the weights to run each time."""
    if isinstance(settings.get("dtype"), torch.dtype):  # torch.bfloat16 -> "bfloat16"
        settings["dtype"] = str(settings["dtype"]).removeprefix("torch.")
    if isinstance(settings.get("device"), torch.device):
        settings["device"] = str(settings["device"])
    given = to_dict(engine_config(config)) if config is not None else {}
    config = resolve_config(
        cfg, from_dict(EngineConfig, {**given, **settings}, "engine settings"), params
    )
    pool = init_pages(
        cfg, config.num_pages, config.page_size, DTYPES[config.dtype], torch.device(config.device)
    )
    return EngineState(cfg, tokenizer, config, init_scheduler(pool, config), [], Totals())


def params_for(state: EngineState, params: Params) -> Params:
    """The weights on the engine's device, in its dtype (a no-op when they already are)."""
    device, dtype = torch.device(state.config.device), DTYPES[state.config.dtype]
    return {k: v.to(device=device, dtype=dtype) for k, v in params.items()}


# ---------------------------------------------------------------- requests in and out


def _tokenize(state: EngineState, prompt) -> list[int]:
    vocab = state.cfg.vocab_size
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise ValueError("text prompts need a tokenizer; pass token ids")
        tokens = state.tokenizer.encode(prompt)
    else:
        tokens = [int(t) for t in prompt]
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of range [0, {vocab}): {bad[:5]}")
    if not tokens:
        raise ValueError("the prompt is empty")
    return tokens


def new_sequence(state: EngineState, request: Request) -> Sequence:
    """Check a request against the engine and build its sequence; raises PromptTooLong or
    ValueError naming what is wrong. Reads only what never changes in the state (the model,
    the tokenizer, the config), so a server may call it on its own thread."""
    sp, config, tok = request.sampling, state.config, state.tokenizer
    tokens = _tokenize(state, request.prompt)
    max_len = len(tokens) + sp.max_tokens
    if max_len > config.max_seq_len:
        raise PromptTooLong(
            f"prompt ({len(tokens)} tokens) + max_tokens ({sp.max_tokens}) = {max_len} "
            f"exceeds max_seq_len ({config.max_seq_len})"
        )
    # the last generated token is never fed back, so it needs no K/V
    if pages_for(max_len - 1, config.page_size) > config.num_pages:
        raise PromptTooLong(
            f"prompt + max_tokens = {max_len} tokens do not fit the page pool "
            f"({config.num_pages} pages of {config.page_size})"
        )
    if sp.logit_bias and not all(0 <= t < state.cfg.vocab_size for t in sp.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {state.cfg.vocab_size})")
    if sp.stop and tok is None:
        raise ValueError("stop strings need a tokenizer")
    stop_ids = frozenset(sp.stop_token_ids)
    if not sp.ignore_eos and tok is not None:
        stop_ids |= tok.stop_ids
    seed = sp.seed if sp.seed is not None else random.getrandbits(63)
    matcher = (
        start_constraint(sp.constraint, tok, state.cfg.vocab_size)
        if sp.constraint is not None
        else None
    )
    return Sequence(
        id=request.id,
        tokens=tokens,
        prompt_len=len(tokens),
        sampling=sp,
        stop_ids=stop_ids,
        generator=torch.Generator().manual_seed(seed),
        max_len=max_len,
        decoder=tok.stream_decoder() if tok is not None else None,
        matcher=matcher,
    )


def enqueue(state: EngineState, seq: Sequence) -> EngineState:
    """A checked sequence (see new_sequence) joins at the end of the queue."""
    state.sched = add_sequence(state.sched, seq)
    return state


def add_request(state: EngineState, request: Request) -> EngineState:
    """The request joins the queue; it is admitted at a step when a place and pages are free.
    Raises PromptTooLong or ValueError for a request the engine cannot serve."""
    return enqueue(state, new_sequence(state, request))


def live_sequences(state: EngineState) -> list[Sequence]:
    return [*state.sched.running, *state.sched.waiting]


def has_work(state: EngineState) -> bool:
    """Whether `engine_step` has anything to do or to hand back."""
    return bool(state.sched.running or state.sched.waiting or state.outbox)


def _retire(
    state: EngineState,
    seq: Sequence,
    reason: str,
    event: StreamEvent | None = None,
    stop_text: str | None = None,
    error: str | None = None,
) -> tuple[EngineState, StreamEvent]:
    """End seq: free (and offer to the prefix cache) its pages; returns its final event."""
    state.sched = finish_sequence(state.sched, seq, cache=reason != "error")
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


def cancel_request(state: EngineState, request_id: str) -> EngineState:
    """Stop a request (a no-op for one that is not there): its pages are freed now, and its
    final event, finish_reason "abort", comes out of the next `engine_step`."""
    for seq in live_sequences(state):
        if seq.id == request_id:
            state, event = _retire(state, seq, "abort")
            state.outbox.append(event)
    return state


def end_all(state: EngineState, reason: str, error: str | None = None) -> EngineState:
    """End every request with `reason` ("abort" or "error"); their final events come out of
    the next `engine_step`."""
    for seq in live_sequences(state):
        state, event = _retire(state, seq, reason, error=error)
        state.outbox.append(event)
    return state


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def forget_cached_kv(state: EngineState) -> EngineState:
    """Call after changing the weights: the prefix cache is dropped, and the K/V of running
    requests (computed with the old weights) is never cached."""
    state.sched = drop_prefix_cache(state.sched)
    return state


# ---------------------------------------------------------------- one step


def _page_table(seqs: list[Sequence]) -> torch.Tensor:
    width = max(len(seq.pages) for seq in seqs)
    return torch.tensor([seq.pages + [0] * (width - len(seq.pages)) for seq in seqs])


def _decode_inputs(seqs: list[Sequence], device) -> tuple[torch.Tensor, ...]:
    """The next token, its position and the page table of each decoding sequence, made from
    one tensor of Python lists instead of three: [token, position, pages...] per row."""
    width = max(len(seq.pages) for seq in seqs)
    rows = torch.tensor(
        [
            [seq.tokens[-1], seq.computed, *seq.pages, *[0] * (width - len(seq.pages))]
            for seq in seqs
        ],
        device=device,
    )
    return rows.select(1, 0), rows.select(1, 1), rows[:, 2:]


def _run_model(
    state: EngineState, params: Params, plan: StepPlan
) -> tuple[EngineState, list[Sequence], torch.Tensor | None]:
    """Run the model over the plan; returns the sequences to sample and their logits."""
    s, cfg, device = state.sched, state.cfg, torch.device(state.config.device)
    rows, logits = [], []
    if plan.decode:
        tokens, positions, table = _decode_inputs(plan.decode, device)
        out, s.pool = decode_step(params, cfg, s.pool, tokens, positions, table)
        rows += plan.decode
        logits.append(out)
    if plan.prefill:
        width = max(n for _, n in plan.prefill)
        chunks = [seq.tokens[seq.computed : seq.computed + n] for seq, n in plan.prefill]
        tokens = torch.tensor([c + [0] * (width - len(c)) for c in chunks], device=device)
        start = torch.tensor([seq.computed for seq, _ in plan.prefill], device=device)
        lengths = torch.tensor([n for _, n in plan.prefill], device=device)
        table = _page_table([seq for seq, _ in plan.prefill])
        out, s.pool = prefill(params, cfg, s.pool, tokens, table, start, lengths)
        # a prompt whose last chunk this was gives its first generated token
        done = [i for i, (seq, n) in enumerate(plan.prefill) if seq.pending == n]
        rows += [plan.prefill[i][0] for i in done]
        logits.append(out[done])
    state.sched = advance(s, plan)
    if not rows:
        return state, rows, None
    return state, rows, logits[0] if len(logits) == 1 else torch.cat(logits)


def _decode_run(
    state: EngineState, params: Params, seqs: list[Sequence], steps: int
) -> tuple[EngineState, list[list[int]]]:
    """`steps` decode steps of seqs back to back, each feeding the tokens sampled from the last
    one, with pages already reserved for them -> each row's tokens. Nothing is checked between
    them: the caller takes the tokens one by one and drops those after a row's end."""
    s, device = state.sched, torch.device(state.config.device)
    settings, generators = [seq.sampling for seq in seqs], [seq.generator for seq in seqs]
    tokens, positions, table = _decode_inputs(seqs, device)
    sampled = []
    for _ in range(steps):
        logits, s.pool = decode_step(params, state.cfg, s.pool, tokens, positions, table)
        tokens = sample_ids(logits, settings, generators, None)
        sampled.append(tokens)
        positions = positions + 1
    return state, torch.stack(sampled, 1).tolist()


def _flush(seq: Sequence) -> str:
    """No more tokens will come: release the held text and the decoder's last bytes, cut at a
    stop string should those bytes complete one."""
    if seq.decoder is None:
        return ""
    held, seq.held = seq.held + seq.decoder.flush(), ""
    text, rest, hit = scan_stops(held, seq.sampling.stop)
    return text if hit is not None else text + rest


def _take_token(
    state: EngineState, seq: Sequence, token: int, logprob: dict | None
) -> tuple[EngineState, StreamEvent]:
    """Append one sampled token: detokenize it, check the stop conditions, make its event.
    A finished grammar stops the request; max_tokens before that gives "length"."""
    seq.tokens.append(token)
    if seq.matcher is not None:
        seq.matcher = accept_token(seq.matcher, token)
    state.totals.completion_tokens += 1
    finish, matched, text = None, None, ""
    if token in seq.stop_ids:
        finish = "stop"
        if state.tokenizer is not None:
            matched = state.tokenizer.decode([token], skip_special_tokens=False)
    elif seq.decoder is not None:
        seq.held += seq.decoder.push(token)
        text, seq.held, hit = scan_stops(seq.held, seq.sampling.stop)
        if hit is not None:
            finish, matched = "stop", hit
    grammar_done = seq.matcher is not None and is_finished(seq.matcher)
    if finish is None and grammar_done:
        finish = "stop"
    if finish is None and len(seq.tokens) >= seq.max_len:
        finish = "length"
    if finish == "length" or token in seq.stop_ids or grammar_done:
        text += _flush(seq)
    event = StreamEvent(
        request_id=seq.id,
        text=text,
        token_ids=[token],
        logprobs=[logprob] if logprob is not None else None,
    )
    if finish is None:
        return state, event
    return _retire(state, seq, finish, event=event, stop_text=matched)


def engine_step(
    state: EngineState, params: Params, step_seconds: float | None = None
) -> tuple[EngineState, list[StreamEvent]]:
    """Advance every request by one scheduler step. Returns (state, events): one event per
    token produced or request finished, final events of cancelled requests first.

    A step that only decodes rows that sample from their logits alone may run several decode
    steps back to back, giving each row that many tokens: as many as `decode_run_length`
    allows for the config and `step_seconds`, the caller's measure of one step's time (None:
    not measured; the run is then `decode_run` steps).
    params are the weights on the engine's device and dtype (see params_for; prepare_params
    lays them out for faster decoding). A failure of the model fails the requests of the step
    (finish_reason "error"); the others go on. The state is donated."""
    events, state.outbox = state.outbox, []
    if not (state.sched.running or state.sched.waiting):
        return state, events
    try:
        state.sched, plan = plan_step(state.sched)
    except Exception as exc:  # pages in an unknown state: end everything, keep serving
        state = end_all(state, "error", describe(exc))
        events, state.outbox = events + state.outbox, []
        return state, events
    if not plan.decode and not plan.prefill:
        return state, events
    steps = decode_run_length(plan, state.config, step_seconds)
    if steps > 1:
        state.sched, reserved = reserve_run(state.sched, plan.decode, steps)
        if reserved:
            return _take_run(state, params, plan.decode, steps, events)
    try:
        state, rows, logits = _run_model(state, params, plan)
        sampled = (
            sample_requests(
                logits,
                [seq.sampling for seq in rows],
                [seq.generator for seq in rows],
                [seq.tokens for seq in rows],
                allowed_tokens([seq.matcher for seq in rows], logits.shape[-1], logits.device),
            )
            if rows
            else []
        )
    except Exception as exc:
        return _fail(state, [*plan.decode, *(seq for seq, _ in plan.prefill)], exc, events)
    state.totals.steps += 1
    for seq, (token, logprob) in zip(rows, sampled):
        state, event = _take_or_fail(state, seq, token, logprob)
        events.append(event)
    return state, events


def _fail(
    state: EngineState, seqs: list[Sequence], exc: Exception, events: list
) -> tuple[EngineState, list[StreamEvent]]:
    """The model failed on a step: its requests end with finish_reason "error" and the
    message, after the events already made."""
    error = describe(exc)
    for seq in seqs:
        state, event = _retire(state, seq, "error", error=error)
        events.append(event)
    return state, events


def _take_or_fail(
    state: EngineState, seq: Sequence, token: int, logprob: dict | None
) -> tuple[EngineState, StreamEvent]:
    """_take_token; a failure there (a detokenizer's, a grammar's) ends this request alone."""
    try:
        return _take_token(state, seq, token, logprob)
    except Exception as exc:
        return _retire(state, seq, "error", error=describe(exc))


def _take_run(
    state: EngineState, params: Params, seqs: list[Sequence], steps: int, events: list
) -> tuple[EngineState, list[StreamEvent]]:
    """The decode run of engine_step: the model's steps, then each row's tokens in order up
    to its end, as if they had come one step at a time."""
    try:
        state, runs = _decode_run(state, params, seqs, steps)
    except Exception as exc:
        return _fail(state, seqs, exc, events)
    state.totals.steps += steps
    for seq, tokens in zip(seqs, runs):
        for token in tokens:
            state.sched = fed(state.sched, seq, 1)  # the K/V of the token fed before this one
            state, event = _take_or_fail(state, seq, token, None)
            events.append(event)
            if event.finish_reason is not None:
                break
    return state, events


def run_requests(
    state: EngineState, params: Params, requests: list[Request]
) -> tuple[EngineState, list[Completion]]:
    """Every request to its end -> (state, their Completions in the order given). All join
    before the first step, so the batch each step runs, and with it every number, is the
    same for the same state, weights and requests: a thread-free `Engine.generate` for
    offline work (RL rollouts, evaluation). Requests already in the state go on as well; the
    call returns once the given ones are done."""
    for request in requests:
        state = add_request(state, request)
    events: dict[str, list[StreamEvent]] = {r.id: [] for r in requests}
    left = len(events)
    while left:
        state, out = engine_step(state, params)
        for event in out:
            if event.request_id in events:
                events[event.request_id].append(event)
                left -= event.finish_reason is not None
    return state, [collect(events[r.id]) for r in requests]


# ---------------------------------------------------------------- what it holds


def engine_stats(state: EngineState) -> dict:
    """Counts of the engine: requests, pages, prefix-cache hits, totals. No clock involved."""
    s, t, total = state.sched, state.totals, state.config.num_pages
    free = num_free_pages(s.pool)
    cached = num_cached_pages(s.cache) if s.cache is not None else 0
    evictable = num_evictable_pages(s.cache, s.pool)
    return {
        "running": len(s.running),
        "waiting": len(s.waiting),
        "pages_total": total,
        "pages_free": free,
        "pages_cached": cached,
        "pages_used": total - free - evictable,  # held by requests
        "prefix_cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        "steps": t.steps,
        "preemptions": s.preemptions,
        "requests_finished": t.finished,
        "requests_aborted": t.aborted,
        "requests_failed": t.errors,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "completion_tokens": t.completion_tokens,
    }
