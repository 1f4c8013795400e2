"""Tool calls in model output: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

This is the form the default chat template asks for (Hermes / Qwen style). Parsing is a pure
step function over text deltas, so streaming and whole-text parsing are the same code: text
that might be the start of a tag is held back until it is clearly not one, and a call is
emitted once its closing tag arrives (or the output ends).
"""

from __future__ import annotations

import json
import secrets

from msgspec import Struct

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ParsedCall(Struct, frozen=True):
    name: str
    arguments: str  # a JSON object as text


class Step(Struct, frozen=True):
    text: str  # content to show now
    calls: tuple[ParsedCall, ...]
    pending: str  # held back: a possible tag start, or an unfinished call


def call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


def parse_call(body: str) -> ParsedCall | None:
    """The JSON between the tags -> a call, or None when it is not one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(data["name"], json.dumps(args, ensure_ascii=False))


def _partial_tag_at_end(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of OPEN."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def _close_of(buf: str, start: int) -> tuple[int, ParsedCall | None]:
    """The closing tag that ends the call opened at `start`: the first after which the body is a
    call (a closing tag may sit inside one of its JSON strings). (-1, None): none yet."""
    end = buf.find(CLOSE, start)
    while end >= 0:
        call = parse_call(buf[start + len(OPEN) : end])
        if call is not None:
            return end, call
        end = buf.find(CLOSE, end + 1)
    return -1, None


def feed(pending: str, delta: str) -> Step:
    """Held-back text + a new delta -> what can be shown, finished calls, what stays held."""
    buf, text, calls = pending + delta, [], []
    while True:
        start = buf.find(OPEN)
        if start < 0:
            keep = _partial_tag_at_end(buf)
            text.append(buf[: len(buf) - keep])
            return Step("".join(text), tuple(calls), buf[len(buf) - keep :])
        text.append(buf[:start])
        end, call = _close_of(buf, start)
        if call is None:  # unfinished, or not a call after all (finish tells)
            return Step("".join(text), tuple(calls), buf[start:])
        calls.append(call)
        buf = buf[end + len(CLOSE) :]


def finish(pending: str) -> Step:
    """The output ended: an unclosed call still counts if its JSON is whole; a call tag that
    never became a call is shown as it was written, up to its first closing tag."""
    if not pending.startswith(OPEN):
        return Step(pending, (), "")
    call = parse_call(pending[len(OPEN) :])
    if call is not None:
        return Step("", (call,), "")
    end = pending.find(CLOSE)
    if end < 0:
        return Step(pending, (), "")
    head = pending[: end + len(CLOSE)]
    rest = feed("", pending[end + len(CLOSE) :])
    last = finish(rest.pending)
    return Step(head + rest.text + last.text, rest.calls + last.calls, "")


def stream_step(parse_tools: bool, pending: str, event) -> Step:
    """One engine event of a stream: the text to show and the calls it completed, given what
    earlier events left held back (`pending`). The final event releases everything held.
    Without tools the text passes through as it is."""
    if not parse_tools:
        return Step(event.text, (), pending)
    step = feed(pending, event.text)
    if event.finish_reason is None:
        return step
    last = finish(step.pending)
    return Step(step.text + last.text, step.calls + last.calls, "")


def parse(text: str) -> tuple[str, list[ParsedCall]]:
    """Whole output -> (content, calls)."""
    step = feed("", text)
    last = finish(step.pending)
    return step.text + last.text, [*step.calls, *last.calls]


def tool_spec(name: str, description: str | None, parameters: dict | None) -> dict:
    """A tool as the chat template sees it: OpenAI's function shape, whichever API sent it, so
    the same tools render the same prompt from either API."""
    function: dict = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object"}
    return {"type": "function", "function": function}
