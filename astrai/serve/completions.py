"""OpenAI text completions: engine streams -> the completion, whole or as Server-Sent Events;
each prompt gets `n` choices, choice `prompt * n + k`. With `echo` a choice's text starts with
its prompt (and its logprobs with the prompt's, see prompt_scoring.py)."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from astrai.infer import Logprob
from astrai.serve import sse
from astrai.serve.bodies import decode_body, json_response
from astrai.serve.chat import finite, token_text
from astrai.serve.engine_requests import completion_generation, completion_prompts
from astrai.serve.openai_shared import error_event, finish_reason
from astrai.serve.prompt_scoring import check_scoring, echoed_entries, prompt_only
from astrai.serve.schemas_openai import (
    CompletionRequest,
    LegacyLogprobs,
    TextChoice,
    TextCompletion,
)
from astrai.serve.state import AppState, check_model, new_id, now
from astrai.serve.streams import collect, open_choices
from astrai.serve.usage import openai_usage

_decoder = msgspec.json.Decoder(CompletionRequest)


def legacy_logprobs(tokenizer, entries: list[Logprob] | None, top: int | None, offset: int):
    """Entries as the engine gives them; an echoed prompt's first token has None for both
    logprob and top, having no context."""
    if top is None or not entries:
        return None
    texts = [token_text(tokenizer, e.token_id) for e in entries]
    offsets = [offset + sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    return LegacyLogprobs(
        tokens=texts,
        token_logprobs=[None if e.logprob is None else finite(e.logprob) for e in entries],
        top_logprobs=[
            None
            if e.top is None
            else {token_text(tokenizer, i): finite(lp) for i, lp in e.top[:top]}
            for e in entries
        ],
        text_offset=offsets,
    )


class CompletionWriter:
    """A text completion stream's chunks (see sse.Writer): the echoed prompt with a choice's
    first text, its finish reason with its last; the usage last when asked for."""

    def __init__(self, head: TextCompletion, texts: list[str], req: CompletionRequest, tokenizer):
        self.response, self.req, self.tokenizer = head, req, tokenizer
        self.texts, self.offsets = texts, [len(t) for t in texts]
        self.prompt_sent, self.usages = [False] * len(texts), [None] * len(texts)

    def chunk(self, choices: list[TextChoice], usage=None) -> bytes:
        r = self.response
        return sse.data(TextCompletion(r.id, r.created, r.model, choices, usage))

    def head(self) -> list[bytes]:
        return []

    def chunks(self, i: int, event) -> list[bytes]:
        text = ("" if self.prompt_sent[i] else self.texts[i]) + event.text
        self.prompt_sent[i] = True
        logprobs = legacy_logprobs(
            self.tokenizer, event.logprobs, self.req.logprobs, self.offsets[i]
        )
        self.offsets[i] += len(event.text)
        reason = finish_reason(event.finish_reason, False)
        if event.finish_reason is not None:
            self.usages[i] = event.usage
        if not (text or logprobs or reason):  # a token held back (a stop string?) says nothing
            return []
        return [self.chunk([TextChoice(i, text, reason, logprobs)])]

    def tail(self) -> list[bytes]:
        options = self.req.stream_options
        usage = [self.chunk([], openai_usage(self.usages, self.req.n))]
        return [*(usage if options and options.include_usage else []), sse.DONE]

    def failure(self, reason: str | None) -> bytes:
        return error_event(reason)


async def completions(state: AppState, body: bytes) -> Response:
    req = decode_body(_decoder, body)
    prompts = completion_prompts(state, req)
    check_scoring(req, prompts, state.context, check_model(state, req.model))
    choice_prompts = [ids for ids in prompts for _ in range(req.n)]
    requests = [] if req.max_tokens == 0 else completion_generation(state, req, prompts).requests
    texts = [state.tokenizer.decode(ids) if req.echo else "" for ids in choice_prompts]
    head = TextCompletion(new_id("cmpl-"), now(), req.model, [])
    if req.stream:
        choices = await open_choices(state.engine, head.id, requests, state.metrics)
        return sse.EventStream(choices, CompletionWriter(head, texts, req, state.tokenizer))
    echoed = await echoed_entries(state, req, prompts)
    if req.max_tokens == 0:
        outcomes = [prompt_only(ids) for ids in choice_prompts]
    else:
        choices = await open_choices(state.engine, head.id, requests, state.metrics)
        outcomes = await collect(choices, len(requests))
    head.choices = [
        TextChoice(
            i,
            texts[i] + o.text,
            finish_reason(o.finish_reason, False),
            legacy_logprobs(
                state.tokenizer,
                echoed[i] + (o.logprobs or []),
                req.logprobs,
                0 if echoed[i] else len(texts[i]),
            ),
        )
        for i, o in enumerate(outcomes)
    ]
    head.usage = openai_usage([o.usage for o in outcomes], req.n)
    return json_response(head, request_id=head.id)
