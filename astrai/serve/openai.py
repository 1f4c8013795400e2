"""OpenAI chat and text completions: request -> engine streams -> JSON or Server-Sent Events.

n choices are n engine requests of one prompt (seeded seed, seed+1, ... when a seed is given,
so that they differ). With tools, calls are parsed out of the model's text (see tools.py) and
returned as `tool_calls`; streamed, each call arrives whole in one delta once its tag closes.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import anyio
import msgspec
from starlette.responses import Response

from astrai.eval.loglik import score_pairs
from astrai.infer import Completion
from astrai.infer.events import Usage as EngineUsage
from astrai.serve import sse, tools
from astrai.serve.chat import finite, token_text
from astrai.serve.engine_requests import (
    chat_generation,
    completion_generation,
    completion_prompts,
)
from astrai.serve.errors import APIError, bad_request, decode_body, openai_body
from astrai.serve.schemas_openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatCompletion,
    ChatRequest,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionRequest,
    Delta,
    FunctionCall,
    LegacyLogprobs,
    TextChoice,
    TextCompletion,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from astrai.serve.state import (
    AppState,
    new_id,
    now,
    prompt_too_long,
)
from astrai.serve.streams import collect, open_choices

_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_encode = msgspec.json.Encoder().encode


def json_response(obj) -> Response:
    return Response(_encode(obj), media_type="application/json")


# ---------------------------------------------------------------- engine output -> response


def usage_of(usages: list, per_prompt: int) -> Usage:
    """Usage of all choices: each prompt counts once (choices share it), completions add up."""
    firsts = [u for u in usages[::per_prompt] if u is not None]
    prompt = sum(u.prompt_tokens for u in firsts)
    cached = sum(u.cached_tokens for u in firsts)
    completion = sum(u.completion_tokens for u in usages if u is not None)
    return Usage(prompt, completion, prompt + completion, {"cached_tokens": cached})


def finish_reason(reason: str | None, called: bool) -> str | None:
    if reason == "stop" and called:
        return "tool_calls"
    return "stop" if reason == "abort" else reason


def chat_logprobs(tokenizer, entries: list[dict] | None, top: int | None):
    if top is None or not entries:
        return None
    content = []
    for entry in entries:
        text = token_text(tokenizer, entry["token_id"])
        alternatives = [
            TopLogprob(t, finite(lp), list(t.encode()))
            for t, lp in ((token_text(tokenizer, i), lp) for i, lp in entry["top"][:top])
        ]
        content.append(
            TokenLogprob(text, finite(entry["logprob"]), list(text.encode()), alternatives)
        )
    return ChoiceLogprobs(content)


def raise_if_failed(outcomes: list[Completion]) -> None:
    for outcome in outcomes:
        if outcome.finish_reason == "error":
            raise APIError(500, f"Generation failed: {outcome.error}")


def chat_choice(i: int, outcome: Completion, tokenizer, parse_tools: bool, top) -> ChatChoice:
    content, calls = outcome.text, []
    if parse_tools:
        content, calls = tools.parse(outcome.text)
    tool_calls = [ToolCall(tools.call_id(), FunctionCall(c.name, c.arguments)) for c in calls]
    message_text = (content.strip() or None) if tool_calls else content
    return ChatChoice(
        index=i,
        message=AssistantMessage(message_text, tool_calls=tool_calls or None),
        finish_reason=finish_reason(outcome.finish_reason, bool(calls)),
        logprobs=chat_logprobs(tokenizer, outcome.logprobs, top),
    )


def error_event(message: str) -> bytes:
    return sse.data(openai_body(APIError(500, f"Generation failed: {message}")))


class ChatStream(msgspec.Struct):
    """What the chat SSE writer needs besides the events."""

    id: str
    created: int
    model: str
    n: int
    parse_tools: bool
    top_logprobs: int | None
    include_usage: bool


async def chat_events(events, spec: ChatStream, tokenizer) -> AsyncIterator[bytes]:
    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        return sse.data(ChatChunk(spec.id, spec.created, spec.model, choices, usage))

    pending, calls_made, usages = [""] * spec.n, [0] * spec.n, [None] * spec.n
    async with contextlib.aclosing(events):
        for i in range(spec.n):
            yield chunk([ChunkChoice(i, Delta(role="assistant", content=""))])
        async for i, event in events:
            if event.finish_reason == "error":
                yield error_event(event.error or "unknown error")
                return
            step = tools.stream_step(spec.parse_tools, pending[i], event)
            text, calls, pending[i] = step.text, step.calls, step.pending
            deltas = [
                ToolCallDelta(calls_made[i] + k, tools.call_id(), FunctionCall(c.name, c.arguments))
                for k, c in enumerate(calls)
            ]
            calls_made[i] += len(calls)
            logprobs = chat_logprobs(tokenizer, event.logprobs, spec.top_logprobs)
            if text or deltas or logprobs:
                delta = Delta(content=text or None, tool_calls=deltas or None)
                yield chunk([ChunkChoice(i, delta, logprobs=logprobs)])
            if event.finish_reason is not None:
                usages[i] = event.usage
                reason = finish_reason(event.finish_reason, calls_made[i] > 0)
                yield chunk([ChunkChoice(i, Delta(), finish_reason=reason)])
    if spec.include_usage:
        yield chunk([], usage_of(usages, spec.n))
    yield sse.DONE


async def chat_completions(state: AppState, body: bytes) -> Response:
    req = decode_body(_chat_decoder, body)
    top = (req.top_logprobs or 0) if req.logprobs else None
    generation = chat_generation(state, req, top)
    events = await open_choices(state.engine, generation.requests, state.metrics)
    spec = ChatStream(
        new_id("chatcmpl-"),
        now(),
        state.model_name,
        req.n,
        generation.parse_tools,
        top,
        bool(req.stream_options and req.stream_options.include_usage),
    )
    if req.stream:
        return sse.EventStream(chat_events(events, spec, state.tokenizer), events)
    outcomes = await collect(events, req.n)
    raise_if_failed(outcomes)
    choices = [
        chat_choice(i, o, state.tokenizer, spec.parse_tools, top) for i, o in enumerate(outcomes)
    ]
    usage = usage_of([o.usage for o in outcomes], req.n)
    return json_response(ChatCompletion(spec.id, spec.created, spec.model, choices, usage))


# ---------------------------------------------------------------- text completions


def legacy_logprobs(tokenizer, entries: list[dict] | None, top: int | None, offset: int):
    """Entries as the engine gives them ({"token_id", "logprob", "top"}); an echoed prompt's
    first token has None for both, having no context."""
    if top is None or not entries:
        return None
    texts = [token_text(tokenizer, e["token_id"]) for e in entries]
    offsets = [offset + sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    return LegacyLogprobs(
        tokens=texts,
        token_logprobs=[None if e["logprob"] is None else finite(e["logprob"]) for e in entries],
        top_logprobs=[
            None
            if e["top"] is None
            else {token_text(tokenizer, i): finite(lp) for i, lp in e["top"][:top]}
            for e in entries
        ],
        text_offset=offsets,
    )


def prompt_entries(engine, prompts: list[list[int]], top: int, context: int) -> list[list[dict]]:
    """Each prompt token's log-probability given the tokens before it, from `forward` on the
    engine's weights, as logprob entries (what lm-evaluation-harness reads from `echo`); the
    first token has none. One prompt per forward pass: a [T, vocab] block of logits at most."""
    pairs = [(ids[:1], ids[1:]) for ids in prompts if len(ids) > 1]
    # on the engine's thread, with its weights: one compute thread in the server process
    scored = iter(
        engine.call(lambda params: score_pairs(params, engine.cfg, pairs, 1, context, top=top))
    )
    entries = []
    for ids in prompts:
        first = [{"token_id": ids[0], "logprob": None, "top": None}] if ids else []
        s = next(scored) if len(ids) > 1 else None
        rest = [] if s is None else [
            {"token_id": t, "logprob": lp, "top": best}
            for t, lp, best in zip(ids[1:], s.logprobs, s.top or [[]] * len(s.logprobs))
        ]  # fmt: skip
        entries.append(first + rest)
    return entries


def check_echo(req: CompletionRequest, prompts: list[list[int]], context: int) -> None:
    """What scoring a prompt needs: max_tokens 0 only with echo, echoed log-probs not streamed,
    the prompt within the context."""
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens is 0, which generates nothing; it needs echo.", "max_tokens")
    scoring = req.max_tokens == 0 or (req.echo and req.logprobs is not None)
    if scoring and req.stream:
        raise bad_request(
            "echo with logprobs (or max_tokens 0) is answered whole: set stream to false.",
            "stream",
        )
    for ids in prompts:
        if req.max_tokens == 0 and len(ids) > context:
            raise prompt_too_long(len(ids), context, "prompt")


async def completion_events(events, head: TextCompletion, texts, req, top, tokenizer):
    """`head` carries id/created/model; `texts` the prompt text per choice when echoing."""
    offsets, echoed = [len(t) for t in texts], [False] * len(texts)
    usages = [None] * len(texts)
    async with contextlib.aclosing(events):
        async for i, event in events:
            if event.finish_reason == "error":
                yield error_event(event.error or "unknown error")
                return
            text = ("" if echoed[i] else texts[i]) + event.text
            echoed[i] = True
            logprobs = legacy_logprobs(tokenizer, event.logprobs, top, offsets[i])
            offsets[i] += len(event.text)
            reason = finish_reason(event.finish_reason, False)
            if event.finish_reason is not None:
                usages[i] = event.usage
            if text or logprobs or reason:  # a token held back (a stop string?) says nothing
                choice = TextChoice(i, text, reason, logprobs)
                yield sse.data(TextCompletion(head.id, head.created, head.model, [choice]))
    if req.stream_options and req.stream_options.include_usage:
        usage = usage_of(usages, req.n)
        yield sse.data(TextCompletion(head.id, head.created, head.model, [], usage))
    yield sse.DONE


async def completions(state: AppState, body: bytes) -> Response:
    req = decode_body(_completion_decoder, body)
    top = req.logprobs
    prompts = completion_prompts(state, req)
    check_echo(req, prompts, state.context)
    choice_prompts = [ids for ids in prompts for _ in range(req.n)]
    requests = [] if req.max_tokens == 0 else completion_generation(state, req, prompts).requests
    texts = [state.tokenizer.decode(ids) if req.echo else "" for ids in choice_prompts]
    head = TextCompletion(new_id("cmpl-"), now(), state.model_name, [])
    if req.stream:
        events = await open_choices(state.engine, requests, state.metrics)
        body = completion_events(events, head, texts, req, top, state.tokenizer)
        return sse.EventStream(body, events)
    echoed = [[] for _ in requests]
    if req.echo and top is not None:  # scored once per prompt, shared by its n choices
        scored = await anyio.to_thread.run_sync(
            prompt_entries, state.engine, prompts, top, state.context
        )
        echoed = [entries for entries in scored for _ in range(req.n)]
    if req.max_tokens == 0:
        outcomes = [
            Completion(finish_reason="length", usage=EngineUsage(len(ids), 0, 0))
            for ids in choice_prompts
        ]
    else:
        events = await open_choices(state.engine, requests, state.metrics)
        outcomes = await collect(events, len(requests))
    raise_if_failed(outcomes)
    head.choices = [
        TextChoice(
            i,
            texts[i] + o.text,
            finish_reason(o.finish_reason, False),
            legacy_logprobs(
                state.tokenizer,
                echoed[i] + (o.logprobs or []),
                top,
                0 if echoed[i] else len(texts[i]),
            ),
        )
        for i, o in enumerate(outcomes)
    ]
    head.usage = usage_of([o.usage for o in outcomes], req.n)
    return json_response(head)
