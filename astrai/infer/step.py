"""Continuous batching as pure functions over one engine state, no thread involved:

    state = init_engine(params, cfg, tokenizer, max_batch=8)
    state = add_request(state, Request("a", "Hello", SamplingParams(max_tokens=16)))
    state, events = engine_step(state, params)     # every request moves one step

`engine_step` plans the step (admission, pages, preemption), runs chunked prefill and one
decode token for the running sequences (or, when every one of them samples from its logits
alone, a run of a few decode steps; with EngineConfig.speculative, one forward that verifies
the tokens proposed for each decoding row, see speculate_step.py), samples, detokenizes,
applies the stop conditions and returns one StreamEvent per token produced or request finished.
Requests join (`add_request`) and leave (`cancel_request`) between steps. Nothing here waits,
and nothing reads a clock unless the caller gives one (`clock`, as the Engine's thread does:
speculation then times its steps, and its gate uses the costs it measured, spec_costs.py):
without one the same state and weights give the same events.

The state is donated to every function that takes it, JAX-style: the page pool and the
sequences are updated in place, and the caller goes on with the state that comes back; using
the one it gave raises DonatedError.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from astrai.infer.adapters import batch_lora
from astrai.infer.constraints import accept_token, allowed_tokens
from astrai.infer.donation import donates
from astrai.infer.events import Completion, Logprob, StreamEvent, collect
from astrai.infer.paged import decode_step, prefill
from astrai.infer.requests import Request
from astrai.infer.sampling import sample_ids, sample_requests
from astrai.infer.scheduler import StepPlan, advance, decode_run_length, fed, plan_step, reserve_run
from astrai.infer.sequence import Sequence, page_table
from astrai.infer.spec_costs import with_decode, with_verify
from astrai.infer.speculate_step import propose, reserve, settle, verify
from astrai.infer.state import EngineState, add_request, describe, end_all, retire
from astrai.infer.text import token_text
from astrai.model import Params


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
    return rows.select(1, 0), rows.select(1, 1), rows[:, 2:].clamp_(min=0)  # as page_table


def _run_model(
    state: EngineState, params: Params, plan: StepPlan
) -> tuple[EngineState, list[Sequence], torch.Tensor | None]:
    """Run the model over the plan; returns the sequences to sample and their logits."""
    s, cfg, device = state.sched, state.model_config, torch.device(state.engine_config.device)
    rows, logits = [], []
    if plan.decode:
        tokens, positions, table = _decode_inputs(plan.decode, device)
        lora = batch_lora(state.adapters, plan.decode)
        out, s.pool = decode_step(params, cfg, s.pool, tokens, positions, table, lora)
        rows += plan.decode
        logits.append(out)
    if plan.prefill:
        width = max(n for _, n in plan.prefill)
        chunks = [seq.tokens[seq.computed : seq.computed + n] for seq, n in plan.prefill]
        tokens = torch.tensor([c + [0] * (width - len(c)) for c in chunks], device=device)
        start = torch.tensor([seq.computed for seq, _ in plan.prefill], device=device)
        lengths = torch.tensor([n for _, n in plan.prefill], device=device)
        seqs = [seq for seq, _ in plan.prefill]
        table, lora = page_table(seqs, device), batch_lora(state.adapters, seqs, width)
        out, s.pool = prefill(params, cfg, s.pool, tokens, table, start, lengths, lora)
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
    s, device = state.sched, torch.device(state.engine_config.device)
    settings, generators = [seq.sampling for seq in seqs], [seq.generator for seq in seqs]
    tokens, positions, table = _decode_inputs(seqs, device)
    lora, sampled = batch_lora(state.adapters, seqs), []
    for _ in range(steps):
        logits, s.pool = decode_step(
            params, state.model_config, s.pool, tokens, positions, table, lora
        )
        tokens = sample_ids(logits, settings, generators, None)
        sampled.append(tokens)
        positions = positions + 1
    return state, torch.stack(sampled, 1).tolist()


def _take_token(
    state: EngineState, seq: Sequence, token: int, logprob: Logprob | None
) -> tuple[EngineState, StreamEvent]:
    """Append one sampled token: advance its grammar, detokenize it, check the stop
    conditions (see text.token_text), make its event."""
    seq.tokens.append(token)
    if seq.matcher is not None:
        seq.matcher = accept_token(seq.matcher, token)
    state.totals.completion_tokens += 1
    text, finish, matched = token_text(seq, token, state.tokenizer)
    event = StreamEvent(
        request_id=seq.id,
        text=text,
        token_ids=[token],
        logprobs=[logprob] if logprob is not None else None,
    )
    if finish is None:
        return state, event
    return retire(state, seq, finish, event=event, stop_text=matched)


@donates
def engine_step(
    state: EngineState,
    params: Params,
    step_seconds: float | None = None,
    clock: Callable[[], float] | None = None,
) -> tuple[EngineState, list[StreamEvent]]:
    """Advance every request by one scheduler step. Returns (state, events): one event per
    token produced or request finished, final events of cancelled requests first.

    A step that only decodes rows that sample from their logits alone may run several decode
    steps back to back, giving each row that many tokens: as many as `decode_run_length`
    allows for the config and `step_seconds`, the caller's measure of one step's time (None:
    not measured; the run is then `decode_run` steps). clock (e.g. time.perf_counter): with
    speculation, the plain decode and verify steps are timed with it, and the gate weighs
    what they measured (spec_costs.py); None: the gate uses its prior and nothing is timed.
    params are the weights on the engine's device and dtype (see params_for; prepare_params
    lays them out for faster decoding). A failure of the model fails the requests of the step
    (finish_reason "error"); the others go on. The state is donated."""
    events, state.final_events = state.final_events, []
    if not (state.sched.running or state.sched.waiting):
        return state, events
    try:
        state.sched, plan = plan_step(state.sched)
    except Exception as exc:  # pages in an unknown state: end everything, keep serving
        state = end_all(state, "error", describe(exc))
        events, state.final_events = events + state.final_events, []
        return state, events
    if not plan.decode and not plan.prefill:
        return state, events
    if state.spec is not None and plan.decode:
        try:
            closed = None if state.sched.waiting else state.sched.running  # none waits to join
            state.spec, proposals = propose(state.spec, plan.decode, clock, closed)
        except Exception as exc:
            return _fail(state, [*plan.decode, *(seq for seq, _ in plan.prefill)], exc, events)
        if any(p.tokens for p in proposals):
            return _take_speculative(state, params, plan, proposals, events, clock)
    steps = decode_run_length(plan, state.engine_config, step_seconds)
    if steps > 1:
        state.sched, reserved = reserve_run(state.sched, plan.decode, steps)
        if reserved:
            return _take_run(state, params, plan.decode, steps, events, clock)
    try:
        started = _now(clock)
        state, rows, logits = _run_model(state, params, plan)
        sampled = _sample(rows, logits)
    except Exception as exc:
        return _fail(state, [*plan.decode, *(seq for seq, _ in plan.prefill)], exc, events)
    if not plan.prefill:  # a prompt chunk in the step would count as decode time
        state = _note_decode(state, len(plan.decode), 1, started, clock)
    state.totals.steps += 1
    for seq, (token, logprob) in zip(rows, sampled):
        state, event = _take_or_fail(state, seq, token, logprob)
        events.append(event)
    return state, events


def _now(clock: Callable[[], float] | None) -> float:
    return clock() if clock is not None else 0.0


def _note_decode(
    state: EngineState, rows: int, steps: int, started: float, clock: Callable[[], float] | None
) -> EngineState:
    """With speculation and a clock: fold the plain decode steps just run (`steps` model
    steps of `rows` rows since `started`) into the measured costs."""
    if state.spec is not None and clock is not None and rows:
        seconds = (clock() - started) / steps
        state.spec.costs = with_decode(state.spec.costs, rows, seconds)
    return state


def _sample(rows: list[Sequence], logits: torch.Tensor | None) -> list:
    """Each row's token, with its Logprob when asked for."""
    if not rows:
        return []
    return sample_requests(
        logits,
        [seq.sampling for seq in rows],
        [seq.generator for seq in rows],
        [seq.tokens for seq in rows],
        allowed_tokens([seq.matcher for seq in rows], logits.shape[-1], logits.device),
    )


def _fail(
    state: EngineState, seqs: list[Sequence], exc: Exception, events: list
) -> tuple[EngineState, list[StreamEvent]]:
    """The model failed on a step: its requests end with finish_reason "error" and the
    message, after the events already made."""
    error = describe(exc)
    for seq in seqs:
        state, event = retire(state, seq, "error", error=error)
        events.append(event)
    return state, events


def _take_or_fail(
    state: EngineState, seq: Sequence, token: int, logprob: Logprob | None
) -> tuple[EngineState, StreamEvent]:
    """_take_token; a failure there (a detokenizer's, a grammar's) ends this request alone."""
    try:
        return _take_token(state, seq, token, logprob)
    except Exception as exc:
        return retire(state, seq, "error", error=describe(exc))


def _take_run(
    state: EngineState,
    params: Params,
    seqs: list[Sequence],
    steps: int,
    events: list,
    clock: Callable[[], float] | None = None,
) -> tuple[EngineState, list[StreamEvent]]:
    """The decode run of engine_step: the model's steps, then each row's tokens in order up
    to its end, as if each had come in a step of its own."""
    try:
        started = _now(clock)
        state, runs = _decode_run(state, params, seqs, steps)
    except Exception as exc:
        return _fail(state, seqs, exc, events)
    state = _note_decode(state, len(seqs), steps, started, clock)
    state.totals.steps += steps
    for seq, tokens in zip(seqs, runs):
        for token in tokens:
            state.sched = fed(state.sched, seq, 1)  # the K/V of the token fed before this one
            state, event = _take_or_fail(state, seq, token, None)
            events.append(event)
            if event.finish_reason is not None:
                break
    return state, events


def _take_speculative(
    state: EngineState,
    params: Params,
    plan: StepPlan,
    proposals: list,
    events: list,
    clock: Callable[[], float] | None = None,
) -> tuple[EngineState, list[StreamEvent]]:
    """The step with speculation (see speculate_step.py): one forward verifies the proposals
    of the decoding rows, the prompt chunks run as usual; each decoding row then takes its
    kept tokens in order up to its end, as if each had come in a step of its own."""
    seqs, prefill_plan = plan.decode, StepPlan([], plan.prefill, plan.preempted)
    try:
        state.sched, proposals = reserve(state.sched, seqs, proposals)
        width = 1 + max(len(p.tokens) for p in proposals)
        lora = batch_lora(state.adapters, seqs, width)
        started = _now(clock)
        state.sched, state.spec, kept, counts = verify(
            state.sched, state.spec, params, state.model_config, seqs, proposals, lora
        )
        if clock is not None:  # the forward and the acceptance, against a plain step's
            seconds = clock() - started
            state.spec.costs = with_verify(state.spec.costs, len(seqs), width - 1, seconds)
        state, rows, logits = _run_model(state, params, prefill_plan)
        sampled = _sample(rows, logits)
    except Exception as exc:
        return _fail(state, [*seqs, *(seq for seq, _ in plan.prefill)], exc, events)
    t = state.totals
    t.steps += 1
    t.spec_steps, t.spec_proposed, t.spec_accepted = (
        a + b for a, b in zip((t.spec_steps, t.spec_proposed, t.spec_accepted), counts)
    )
    for seq, tokens in zip(seqs, kept):
        for token, logprob in tokens:
            state.sched = fed(state.sched, seq, 1)  # the K/V of the token fed before this one
            state, event = _take_or_fail(state, seq, token, logprob)
            events.append(event)
            if event.finish_reason is not None:
                break
        else:
            state.sched, state.spec = settle(state.sched, state.spec, seq)
    for seq, (token, logprob) in zip(rows, sampled):
        state, event = _take_or_fail(state, seq, token, logprob)
        events.append(event)
    return state, events


@donates
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
