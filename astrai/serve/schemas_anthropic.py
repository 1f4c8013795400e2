"""Anthropic Messages request and response bodies as msgspec Structs.

Content blocks are a tagged union on "type": text, tool_use and tool_result are understood; any
other block (image, document, ...) is a 400 naming where it was.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

# ---------------------------------------------------------------- requests

# Counts beyond any vocabulary or context are refused, as in the OpenAI schemas: no integer too
# large for torch's 64 bits reaches the engine.
MAX_COUNT = 2**31 - 1


class TextBlock(Struct, tag_field="type", tag="text", omit_defaults=True):
    text: str
    cache_control: dict[str, Any] | None = None  # accepted; our prefix cache needs no hints
    citations: list[Any] | None = None


class ToolUseBlock(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Struct, tag_field="type", tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


Block = TextBlock | ToolUseBlock | ToolResultBlock


class Message(Struct):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Meta(min_length=1)]  # as Anthropic: no empty list


class ToolDef(Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None  # "custom", when given
    cache_control: dict[str, Any] | None = None


class ToolChoiceAuto(Struct, tag_field="type", tag="auto"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(Struct, tag_field="type", tag="any"):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Struct, tag_field="type", tag="tool"):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Struct, tag_field="type", tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class MessagesRequest(Struct, kw_only=True):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_COUNT)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Meta(max_length=16)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=MAX_COUNT)] | None = None
    metadata: dict[str, Any] | None = None
    stream: bool = False
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None


class CountTokensRequest(Struct, kw_only=True):
    model: str
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None


# ---------------------------------------------------------------- responses


class OutTextBlock(Struct, tag_field="type", tag="text"):
    text: str


class OutToolUseBlock(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


OutBlock = OutTextBlock | OutToolUseBlock


class Usage(Struct):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class MessageResponse(Struct, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[OutBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


class TokenCount(Struct):
    input_tokens: int


# ---------------------------------------------------------------- stream events


class MessageStart(Struct, tag_field="type", tag="message_start"):
    message: MessageResponse


class ContentBlockStart(Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: OutBlock


class Ping(Struct, tag_field="type", tag="ping"):
    pass


class TextDelta(Struct, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStop(Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(Struct):
    stop_reason: str | None
    stop_sequence: str | None


class DeltaUsage(Struct):
    """Cumulative totals; the input counts are only known once the prompt is processed."""

    output_tokens: int
    input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageDelta(Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: DeltaUsage


class MessageStop(Struct, tag_field="type", tag="message_stop"):
    pass


def event_name(event: Struct) -> str:
    """The SSE `event:` line of a stream event is its "type" tag."""
    return type(event).__struct_config__.tag
