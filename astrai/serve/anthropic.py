"""Anthropic Messages: request -> engine stream -> message JSON or the SSE event sequence.

Streams follow Anthropic's order: message_start, then per content block content_block_start /
content_block_delta... / content_block_stop (a ping after the first start), then message_delta
with the stop reason and usage, then message_stop. The request becomes a prompt in
anthropic_turns.py and engine_requests.py.
"""

from __future__ import annotations

import json

import msgspec
from starlette.responses import Response

from astrai.serve import sse, tools
from astrai.serve.bodies import decode_body, json_response
from astrai.serve.engine_requests import message_generation, message_prompt
from astrai.serve.errors import anthropic_body, generation_failed
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
    TextDelta,
    TokenCount,
    Usage,
    event_name,
)
from astrai.serve.state import AppState, check_model, new_id
from astrai.serve.streams import collect, open_choices
from astrai.serve.usage import anthropic_usage

_messages_decoder = msgspec.json.Decoder(MessagesRequest)
_count_decoder = msgspec.json.Decoder(CountTokensRequest)


# ---------------------------------------------------------------- engine output -> message


def stop_reason(reason: str | None, stop_sequence: str | None, called: bool) -> str:
    if called and reason == "stop":
        return "tool_use"
    if reason == "length":
        return "max_tokens"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


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


class MessageSpec(msgspec.Struct):
    """What a message answer says besides the model's output: the message so far (id, model,
    the prompt's usage), and what the output is read for."""

    message: MessageResponse
    parse_tools: bool
    n_prompt: int
    stop_sequences: list[str]


def matched_sequence(stop_text: str | None, stop_sequences: list[str]) -> str | None:
    """The engine names what stopped it (also an end-of-turn token); Anthropic reports only
    the client's own stop sequences."""
    return stop_text if stop_text in stop_sequences else None


class MessageWriter:
    """A message stream's events (see sse.Writer): message_start, the content blocks as text
    and tool calls arrive, and with the last event the stop reason, usage and message_stop."""

    def __init__(self, spec: MessageSpec):
        self.spec, self.blocks, self.pending, self.called = spec, Blocks(), "", False

    def head(self) -> list[bytes]:
        return _named([MessageStart(self.spec.message)])

    def chunks(self, i: int, event) -> list[bytes]:
        spec = self.spec
        step = tools.stream_step(spec.parse_tools, self.pending, event)
        self.pending = step.pending
        items = text_events(self.blocks, step.text)
        for call in step.calls:
            items += call_events(self.blocks, call)
        self.called = self.called or bool(step.calls)
        if event.finish_reason is not None:
            usage = anthropic_usage(event.usage, spec.n_prompt)
            stop_text = matched_sequence(event.stop_reason_text, spec.stop_sequences)
            delta = StopDelta(stop_reason(event.finish_reason, stop_text, self.called), stop_text)
            counts = DeltaUsage(
                usage.output_tokens, usage.input_tokens, usage.cache_read_input_tokens
            )
            items += [*final_events(self.blocks), MessageDelta(delta, counts), MessageStop()]
        return _named(items)

    def tail(self) -> list[bytes]:
        return []

    def failure(self, reason: str | None) -> bytes:
        return sse.named("error", anthropic_body(generation_failed(reason)))


def _named(items: list) -> list[bytes]:
    return [sse.named(event_name(e), e) for e in items]


def message_content(text: str, calls: list[tools.ParsedCall]) -> list:
    text = text.strip() if calls else text
    blocks = [OutTextBlock(text)] if text or not calls else []
    return blocks + [tool_use_block(c) for c in calls]


async def messages(state: AppState, body: bytes) -> Response:
    req = decode_body(_messages_decoder, body)
    generation = message_generation(state, req)
    request_id = new_id("msg_")
    choices = await open_choices(state.engine, request_id, generation.requests, state.metrics)
    prompt = generation.requests[0].prompt
    head = MessageResponse(request_id, req.model, [], None, None, Usage(len(prompt), 1))
    spec = MessageSpec(head, generation.parse_tools, len(prompt), req.stop_sequences or [])
    if req.stream:
        return sse.EventStream(choices, MessageWriter(spec))
    (outcome,) = await collect(choices, 1)
    text, calls = outcome.text, []
    if spec.parse_tools:
        text, calls = tools.parse(outcome.text)
    head.content = message_content(text, calls)
    head.stop_sequence = matched_sequence(outcome.stop_reason_text, spec.stop_sequences)
    head.stop_reason = stop_reason(outcome.finish_reason, head.stop_sequence, bool(calls))
    head.usage = anthropic_usage(outcome.usage, len(prompt))
    return json_response(head, request_id=request_id)


async def count_tokens(state: AppState, body: bytes) -> Response:
    req = decode_body(_count_decoder, body)
    check_model(state, req.model)
    prompt, _ = message_prompt(state, req)
    return json_response(TokenCount(len(prompt)))
