"""Anthropic Messages: request -> engine stream -> message JSON or the SSE event sequence.

A conversation is turned into the same template messages the OpenAI side builds (tool_use
blocks become assistant tool calls, tool_result blocks become tool turns), so one chat
template serves both APIs. Streams follow Anthropic's order: message_start, then per content
block content_block_start / content_block_delta... / content_block_stop (a ping after the
first start), then message_delta with the stop reason and usage, then message_stop.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import msgspec
from starlette.responses import Response

from astrai.infer import Constraint
from astrai.serve import sse, structured, tools
from astrai.serve.chat import chat_prompt
from astrai.serve.errors import APIError, anthropic_body, bad_request, from_decode_error
from astrai.serve.schemas_anthropic import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    DeltaUsage,
    InputJsonDelta,
    MessageDelta,
    MessageResponse,
    MessagesRequest,
    MessageStart,
    MessageStop,
    OutTextBlock,
    OutToolUseBlock,
    Ping,
    StopDelta,
    TextBlock,
    TextDelta,
    TokenCount,
    ToolChoiceAny,
    ToolChoiceNone,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
    Usage,
    event_name,
)
from astrai.serve.state import AppState, check_generates, check_model, new_id, token_budget
from astrai.serve.streams import collect, open_choices

_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)
_encode = msgspec.json.Encoder().encode


def decode(decoder: msgspec.json.Decoder, body: bytes):
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None


# ---------------------------------------------------------------- request -> template messages


def joined_text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content)


def tool_result_turn(block: ToolResultBlock) -> dict:
    text = joined_text(block.content)
    return {
        "role": "tool",
        "tool_call_id": block.tool_use_id,
        "content": f"Error: {text}" if block.is_error else text,
    }


def user_turns(blocks: list, where: str) -> list[dict]:
    """Tool results come first as tool turns, then the user's text (if any) as one turn."""
    if any(isinstance(b, ToolUseBlock) for b in blocks):
        raise bad_request(f"{where}: tool_use blocks belong in assistant messages.", where)
    turns = [tool_result_turn(b) for b in blocks if isinstance(b, ToolResultBlock)]
    texts = [b.text for b in blocks if isinstance(b, TextBlock)]
    return turns + ([{"role": "user", "content": "\n".join(texts)}] if texts or not turns else [])


def assistant_turn(blocks: list, where: str) -> dict:
    if any(isinstance(b, ToolResultBlock) for b in blocks):
        raise bad_request(f"{where}: tool_result blocks belong in user messages.", where)
    turn = {
        "role": "assistant",
        "content": "".join(b.text for b in blocks if isinstance(b, TextBlock)),
    }
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in blocks
        if isinstance(b, ToolUseBlock)
    ]
    return {**turn, "tool_calls": calls} if calls else turn


def template_messages(req: MessagesRequest | CountTokensRequest) -> list[dict]:
    turns = [] if req.system is None else [{"role": "system", "content": joined_text(req.system)}]
    for k, message in enumerate(req.messages):
        content = message.content
        if isinstance(content, str):
            turns.append({"role": message.role, "content": content})
        elif message.role == "assistant":
            turns.append(assistant_turn(content, f"messages[{k}].content"))
        else:
            turns += user_turns(content, f"messages[{k}].content")
    return turns


def message_tools(req: MessagesRequest | CountTokensRequest) -> list[dict] | None:
    """The tools for the template; none with tool_choice none."""
    choice = req.tool_choice
    if not req.tools or isinstance(choice, ToolChoiceNone):
        return None
    if isinstance(choice, ToolChoiceTool):
        names = [t.name for t in req.tools]
        if choice.name not in names:
            raise bad_request(
                f"tool_choice.name: `{choice.name}` is not among tools {names}.", "tool_choice"
            )
    return [tools.tool_spec(t.name, t.description, t.input_schema) for t in req.tools]


def tool_grammar(state: AppState, req: MessagesRequest) -> Constraint | None:
    """The answer's grammar: `any` forces calls of any tool, `tool` a call of that one (its
    input following the tool's input_schema), `auto` text or calls."""
    choice = req.tool_choice
    if not req.tools or isinstance(choice, ToolChoiceNone):
        return None
    functions = {t.name: t.input_schema for t in req.tools}
    named = isinstance(choice, ToolChoiceTool)
    mode = "named" if named else "required" if isinstance(choice, ToolChoiceAny) else "auto"
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    return structured.request_constraint(
        None, state.tokenizer, state.vocab_size, functions, mode,
        choice.name if named else None, parallel,
    )  # fmt: skip


def split_prefill(turns: list[dict]) -> tuple[list[dict], str]:
    """A conversation that ends in an assistant turn asks for that turn to be continued: its
    text starts the answer (and, as in Anthropic's API, is not repeated in the response)."""
    last = turns[-1]
    if last["role"] == "assistant" and "tool_calls" not in last:
        return turns[:-1], last["content"]
    return turns, ""


def build_prompt(state: AppState, req: MessagesRequest | CountTokensRequest):
    """-> (prompt ids, whether tools are in play)."""
    specs = message_tools(req)
    turns, prefill = split_prefill(template_messages(req))
    prompt = chat_prompt(state.tokenizer, turns, specs, prefill)
    return prompt, specs is not None


def sampling_kwargs(req: MessagesRequest, max_tokens: int) -> dict:
    kwargs = {
        "max_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k or None,
        "stop": [s for s in req.stop_sequences or () if s] or None,
    }
    return {k: v for k, v in kwargs.items() if v is not None}


# ---------------------------------------------------------------- engine output -> message


def stop_reason(reason: str | None, stop_sequence: str | None, called: bool) -> str:
    if called and reason == "stop":
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def usage_of(usage, fallback_prompt: int) -> Usage:
    if usage is None:
        return Usage(fallback_prompt, 0)
    cached = usage.cached_tokens
    return Usage(usage.prompt_tokens - cached, usage.completion_tokens, cached)


def tool_use_block(call: tools.ParsedCall) -> OutToolUseBlock:
    return OutToolUseBlock(tools.call_id("toolu_"), call.name, json.loads(call.arguments))


class Blocks(msgspec.Struct):
    """The content blocks a stream has opened so far; `open` is the kind still open."""

    count: int = 0
    open: str | None = None


def _start(blocks: Blocks, block) -> list:
    events = [ContentBlockStart(blocks.count, block)]
    if blocks.count == 0:
        events.append(Ping())
    blocks.count += 1
    blocks.open = type(block).__struct_config__.tag
    return events


def _close(blocks: Blocks) -> list:
    if blocks.open is None:
        return []
    blocks.open = None
    return [ContentBlockStop(blocks.count - 1)]


def text_events(blocks: Blocks, text: str) -> list:
    if not text:
        return []
    events = [] if blocks.open == "text" else _close(blocks) + _start(blocks, OutTextBlock(""))
    return [*events, ContentBlockDelta(blocks.count - 1, TextDelta(text))]


def call_events(blocks: Blocks, call: tools.ParsedCall) -> list:
    block = tool_use_block(call)
    arguments = call.arguments
    block.input = {}  # the input arrives as JSON deltas, the way the client accumulates it
    return [
        *_close(blocks),
        *_start(blocks, block),
        ContentBlockDelta(blocks.count - 1, InputJsonDelta(arguments)),
        *_close(blocks),
    ]


def final_events(blocks: Blocks) -> list:
    if blocks.count == 0:  # nothing was said: still one (empty) text block
        return _start(blocks, OutTextBlock("")) + _close(blocks)
    return _close(blocks)


class MessageStream(msgspec.Struct):
    head: MessageResponse
    parse_tools: bool
    n_prompt: int
    stop_sequences: list[str]


def matched_sequence(stop_text: str | None, stop_sequences: list[str]) -> str | None:
    """The engine names what stopped it (also an end-of-turn token); Anthropic reports only
    the client's own stop sequences."""
    return stop_text if stop_text in stop_sequences else None


def error_event(message: str) -> bytes:
    body = anthropic_body(APIError(500, f"Generation failed: {message}"))
    return sse.named("error", body)


async def message_events(events, spec: MessageStream) -> AsyncIterator[bytes]:
    def out(items: list) -> bytes:
        return b"".join(sse.named(event_name(e), e) for e in items)

    blocks, pending, called = Blocks(), "", False
    async with contextlib.aclosing(events):
        yield out([MessageStart(spec.head)])
        async for _, event in events:
            if event.finish_reason == "error":
                yield error_event(event.error or "unknown error")
                return
            step = tools.stream_step(spec.parse_tools, pending, event)
            text, calls, pending = step.text, step.calls, step.pending
            items = text_events(blocks, text)
            for call in calls:
                items += call_events(blocks, call)
            called = called or bool(calls)
            if event.finish_reason is not None:
                usage = usage_of(event.usage, spec.n_prompt)
                stop_text = matched_sequence(event.stop_reason_text, spec.stop_sequences)
                delta = StopDelta(stop_reason(event.finish_reason, stop_text, called), stop_text)
                counts = DeltaUsage(
                    usage.output_tokens, usage.input_tokens, usage.cache_read_input_tokens
                )
                items += [*final_events(blocks), MessageDelta(delta, counts), MessageStop()]
            if items:
                yield out(items)


def message_content(text: str, calls: list[tools.ParsedCall]) -> list:
    text = text.strip() if calls else text
    blocks = [OutTextBlock(text)] if text or not calls else []
    return blocks + [tool_use_block(c) for c in calls]


async def messages(state: AppState, body: bytes) -> Response:
    req = decode(_messages_decoder, body)
    check_model(state, req.model)
    check_generates(state)
    prompt, with_tools = build_prompt(state, req)
    constraint = tool_grammar(state, req)
    budget = token_budget(len(prompt), req.max_tokens, state.context, 0, "max_tokens", "messages")
    kwargs = sampling_kwargs(req, budget)
    if constraint is not None:
        kwargs["constraint"] = constraint
    events = await open_choices(state.engine, [(prompt, kwargs)], state.metrics)
    head = MessageResponse(new_id("msg_"), state.model_name, [], None, None, Usage(len(prompt), 1))
    spec = MessageStream(head, with_tools, len(prompt), req.stop_sequences or [])
    if req.stream:
        return sse.EventStream(message_events(events, spec), events)
    (outcome,) = await collect(events, 1)
    if outcome.finish_reason == "error":
        raise APIError(500, f"Generation failed: {outcome.error}")
    text, calls = outcome.text, []
    if spec.parse_tools:
        text, calls = tools.parse(outcome.text)
    head.content = message_content(text, calls)
    head.stop_sequence = matched_sequence(outcome.stop_reason_text, spec.stop_sequences)
    head.stop_reason = stop_reason(outcome.finish_reason, head.stop_sequence, bool(calls))
    head.usage = usage_of(outcome.usage, len(prompt))
    return Response(_encode(head), media_type="application/json")


async def count_tokens(state: AppState, body: bytes) -> Response:
    req = decode(_count_decoder, body)
    check_model(state, req.model)
    prompt, _ = build_prompt(state, req)
    return Response(_encode(TokenCount(len(prompt))), media_type="application/json")
