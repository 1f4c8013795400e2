"""OpenAI request and response bodies as msgspec Structs: decoding a body validates it.

Fields the server does not act on (`user`, `metadata`, `store`, ...) are accepted and ignored,
as OpenAI clients send them freely; a field with the wrong type or range is a 400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
# Counts (tokens, choices, top-k) beyond any vocabulary or context are refused here, so that no
# integer too large for torch's 64 bits reaches the engine.
MAX_COUNT = 2**31 - 1
PositiveInt = Annotated[int, Meta(ge=1, le=MAX_COUNT)]
Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Stop = str | Annotated[list[str], Meta(max_length=16)] | None


# ---------------------------------------------------------------- requests


class TextPart(Struct, tag_field="type", tag="text"):
    text: str


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Struct):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(Struct, omit_defaults=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def __post_init__(self):
        # as OpenAI: only an assistant turn that calls tools may leave its content out
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs `content`")


class FunctionDef(Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct):
    function: FunctionDef
    type: Literal["function"] = "function"


class FunctionName(Struct):
    name: str


class NamedToolChoice(Struct):
    function: FunctionName
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(Struct):
    include_usage: bool = False


class JsonSchemaSpec(Struct):
    name: str
    schema: dict[str, Any] | bool = {}
    strict: bool | None = None
    description: str | None = None


class TextFormat(Struct, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(Struct, tag_field="type", tag="json_object"):
    pass


class JsonSchemaFormat(Struct, tag_field="type", tag="json_schema"):
    json_schema: JsonSchemaSpec


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StructuredOutputs(Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` extra body field: one of these."""

    json: dict[str, Any] | bool | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(Struct, kw_only=True):
    """What chat and text completions share."""

    model: str
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Meta(ge=-1, le=MAX_COUNT)] | None = None  # beyond OpenAI, as vLLM has it
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    max_tokens: PositiveInt | None = None
    n: PositiveInt = 1
    stop: Stop = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None  # what torch takes
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[int, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # beyond OpenAI, as vLLM has it: only max_tokens and stop end it
    response_format: ResponseFormat | None = None
    # vLLM's extra body fields for constrained decoding (the newer one and the older names)
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class ChatRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


# text, texts, token ids or lists of token ids; msgspec allows one list type in a union, so the
# items are checked to be all of one kind when the request is read
Prompt = str | list[str | int | list[int]]


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Prompt
    max_tokens: Count | None = None  # 0: score the prompt (with echo)
    logprobs: Count | None = None  # the legacy API: a count of alternatives
    echo: bool = False
    suffix: None = None  # fill-in-the-middle is not supported; any value is a 400


class EmbeddingRequest(Struct, kw_only=True):
    model: str
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: PositiveInt | None = None
    user: str | None = None


# ---------------------------------------------------------------- responses


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob]


class AssistantMessage(Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class ToolCallDelta(Struct):
    index: int
    id: str
    function: FunctionCall
    type: str = "function"


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class LegacyLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token has no context
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TextChoice(Struct):
    index: int
    text: str
    finish_reason: str | None
    logprobs: LegacyLogprobs | None = None


class TextCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class Model(Struct):
    """One model, written so that the OpenAI and the Anthropic clients both read it."""

    id: str
    created: int
    created_at: str
    display_name: str
    object: str = "model"
    owned_by: str = "astrai"
    type: str = "model"
    parent: str | None = None  # an adapter's base model, as vLLM lists LoRA adapters


class AdapterLoad(Struct, forbid_unknown_fields=True):
    """POST /v1/adapters: load the adapter folder at `path` (PEFT's, or a `just train` run's)
    under `name`."""

    name: str
    path: str


class AdapterDeleted(Struct):
    id: str
    object: str = "adapter"
    deleted: bool = True


class ModelList(Struct):
    data: list[Model]
    first_id: str | None
    last_id: str | None
    has_more: bool = False
    object: str = "list"


class Embedding(Struct):
    index: int
    embedding: list[float] | str
    object: str = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(Struct):
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: str = "list"
