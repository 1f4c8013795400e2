"""OpenAI chat completions: engine streams -> the chat completion, whole or as Server-Sent
Events.

With tools, calls are parsed out of the model's text (see tools.py) and returned as
`tool_calls`; streamed, each call arrives whole in one delta once its tag closes.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from astrai.infer import Completion, Logprob
from astrai.serve import sse, tools
from astrai.serve.bodies import decode_body, json_response
from astrai.serve.chat import finite, token_text
from astrai.serve.engine_requests import chat_generation
from astrai.serve.openai_shared import error_event, finish_reason
from astrai.serve.schemas_openai import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatCompletion,
    ChatRequest,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    FunctionCall,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from astrai.serve.state import AppState, new_id, now
from astrai.serve.streams import collect, open_choices
from astrai.serve.usage import openai_usage

_decoder = msgspec.json.Decoder(ChatRequest)


def chat_logprobs(tokenizer, entries: list[Logprob] | None, top: int | None):
    if top is None or not entries:
        return None
    content = []
    for entry in entries:
        text = token_text(tokenizer, entry.token_id)
        alternatives = [
            TopLogprob(t, finite(lp), list(t.encode()))
            for t, lp in ((token_text(tokenizer, i), lp) for i, lp in entry.top[:top])
        ]
        content.append(TokenLogprob(text, finite(entry.logprob), list(text.encode()), alternatives))
    return ChoiceLogprobs(content)


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


class ChatSpec(msgspec.Struct):
    """What a chat answer says besides the model's output, streamed or whole."""

    id: str
    created: int
    model: str
    n: int
    parse_tools: bool
    top_logprobs: int | None
    include_usage: bool


class ChatWriter:
    """A chat stream's chunks (see sse.Writer): each choice opens with its role, then deltas
    of text and whole tool calls, then its finish reason; the usage last when asked for."""

    def __init__(self, spec: ChatSpec, tokenizer):
        self.spec, self.tokenizer = spec, tokenizer
        self.pending, self.calls_made = [""] * spec.n, [0] * spec.n
        self.usages: list = [None] * spec.n

    def chunk(self, choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        spec = self.spec
        return sse.data(ChatChunk(spec.id, spec.created, spec.model, choices, usage))

    def head(self) -> list[bytes]:
        return [
            self.chunk([ChunkChoice(i, Delta(role="assistant", content=""))])
            for i in range(self.spec.n)
        ]

    def chunks(self, i: int, event) -> list[bytes]:
        step = tools.stream_step(self.spec.parse_tools, self.pending[i], event)
        text, calls, self.pending[i] = step.text, step.calls, step.pending
        deltas = [
            ToolCallDelta(
                self.calls_made[i] + k, tools.call_id(), FunctionCall(c.name, c.arguments)
            )
            for k, c in enumerate(calls)
        ]
        self.calls_made[i] += len(calls)
        logprobs = chat_logprobs(self.tokenizer, event.logprobs, self.spec.top_logprobs)
        out = []
        if text or deltas or logprobs:
            delta = Delta(content=text or None, tool_calls=deltas or None)
            out.append(self.chunk([ChunkChoice(i, delta, logprobs=logprobs)]))
        if event.finish_reason is not None:
            self.usages[i] = event.usage
            reason = finish_reason(event.finish_reason, self.calls_made[i] > 0)
            out.append(self.chunk([ChunkChoice(i, Delta(), finish_reason=reason)]))
        return out

    def tail(self) -> list[bytes]:
        usage = [self.chunk([], openai_usage(self.usages, self.spec.n))]
        return [*(usage if self.spec.include_usage else []), sse.DONE]

    def failure(self, reason: str | None) -> bytes:
        return error_event(reason)


async def chat_completions(state: AppState, body: bytes) -> Response:
    req = decode_body(_decoder, body)
    top = (req.top_logprobs or 0) if req.logprobs else None
    generation = chat_generation(state, req, top)
    request_id = new_id("chatcmpl-")
    choices = await open_choices(state.engine, request_id, generation.requests, state.metrics)
    spec = ChatSpec(
        request_id,
        now(),
        req.model,
        req.n,
        generation.parse_tools,
        top,
        bool(req.stream_options and req.stream_options.include_usage),
    )
    if req.stream:
        return sse.EventStream(choices, ChatWriter(spec, state.tokenizer))
    outcomes = await collect(choices, req.n)
    answers = [
        chat_choice(i, o, state.tokenizer, spec.parse_tools, top) for i, o in enumerate(outcomes)
    ]
    usage = openai_usage([o.usage for o in outcomes], req.n)
    completion = ChatCompletion(spec.id, spec.created, spec.model, answers, usage)
    return json_response(completion, request_id=request_id)
