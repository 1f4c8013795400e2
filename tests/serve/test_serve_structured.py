"""Structured outputs through the official clients against a real server: response_format
(json_object, json_schema, a Pydantic model via `parse`), vLLM's extra fields, tool calls forced
by OpenAI's and Anthropic's tool_choice, streaming, and 400s naming an unsupported schema."""

from __future__ import annotations

import json
import re
from typing import Literal

import anthropic
import jsonschema
import openai
import pytest
from json_prefix import assert_follows_schema, assert_json_prefix
from pydantic import BaseModel, Field
from tiny_server import API_KEY, HELLO_Q, MODEL, WEATHER_Q, WEATHER_TOOL, engine_for, serving

from astrai.config import ServeConfig

HELLO = [{"role": "user", "content": HELLO_Q}]
WEATHER = [{"role": "user", "content": WEATHER_Q}]
BOOKING = {
    "name": "book_table",
    "description": "Book a table.",
    "parameters": {
        "type": "object",
        "properties": {
            "people": {"type": "integer", "minimum": 1, "maximum": 12},
            "time": {"enum": ["noon", "evening"]},
            "terrace": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 8},
        },
        "required": ["people", "time"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": WEATHER_TOOL}, {"type": "function", "function": BOOKING}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": -3, "maximum": 30},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["n", "tags"],
    "additionalProperties": False,
}


class Point(BaseModel):
    x: int = Field(ge=0, le=9)
    label: Literal["left", "right"]
    visible: bool


@pytest.fixture(scope="module")
def server(tiny):
    cfg = ServeConfig(api_key=API_KEY, default_max_tokens=64)
    with engine_for(tiny, max_batch=8) as engine, serving(engine, cfg) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0)


def chat(client, messages=HELLO, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def json_format(schema, strict=True):
    return {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": schema, "strict": strict},
    }


# ---------------------------------------------------------------- response_format


def test_parse_returns_the_pydantic_object(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=HELLO, response_format=Point, max_tokens=60, seed=1
    )
    point = r.choices[0].message.parsed
    assert isinstance(point, Point) and 0 <= point.x <= 9


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_validates(client, strict):
    for seed in range(3):
        r = chat(client, response_format=json_format(SCHEMA, strict), max_tokens=60, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_schema_streams(client):
    stream = chat(client, response_format=json_format(SCHEMA), max_tokens=60, seed=4, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_on_text_completions(client):
    # Any object: its strings may run on, so some samples reach max_tokens (each checked as the
    # start of an object); of eight, some close.
    finishes = []
    for seed in range(8):
        r = client.completions.create(
            model=MODEL, prompt="Data:", max_tokens=150, seed=seed,
            extra_body={"response_format": {"type": "json_object"}},
        )  # fmt: skip
        choice = r.choices[0]
        assert_follows_schema(choice.text, {"type": "object"}, choice.finish_reason)
        assert choice.finish_reason == "stop" or r.usage.completion_tokens == 150
        finishes.append(choice.finish_reason)
    assert "stop" in finishes, finishes


def test_max_tokens_before_the_object_closes_is_length(client):
    r = chat(client, response_format=json_format(SCHEMA), max_tokens=3, seed=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert_json_prefix(r.choices[0].message.content, SCHEMA)


# ---------------------------------------------------------------- vLLM's extra fields


def test_guided_regex_and_choice(client):
    r = chat(client, max_tokens=20, seed=0, extra_body={"guided_regex": "[A-F]{2}-[0-9]{2}"})
    assert re.fullmatch("[A-F]{2}-[0-9]{2}", r.choices[0].message.content)
    r = chat(client, max_tokens=20, seed=0, extra_body={"guided_choice": ["alpha", "beta"]})
    assert r.choices[0].message.content in {"alpha", "beta"}
    so = {"structured_outputs": {"choice": ["up", "down"]}}
    r = client.completions.create(model=MODEL, prompt="Go", max_tokens=5, seed=1, extra_body=so)
    assert r.choices[0].text in {"up", "down"}
    r = chat(client, max_tokens=40, seed=3, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    grammar = 'start: "ok " NUM\nNUM: /[0-9]{1,3}/'
    r = chat(client, max_tokens=10, seed=3, extra_body={"guided_grammar": grammar})
    assert re.fullmatch("ok [0-9]{1,3}", r.choices[0].message.content)


def test_unsupported_schema_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, response_format=json_format({"type": "array", "uniqueItems": True}))
    assert err.value.body["param"] == "response_format"
    assert "uniqueItems" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, extra_body={"guided_regex": "(unclosed"})
    assert err.value.body["param"] == "guided_regex"
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, extra_body={"guided_regex": "a", "guided_choice": ["b"]})


# ---------------------------------------------------------------- tool calls


def assert_valid_calls(calls):
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_named_tool_call_validates(client):
    named = {"type": "function", "function": {"name": "book_table"}}
    for seed in range(3):
        r = chat(client, WEATHER, tools=TOOLS, tool_choice=named, max_tokens=160, seed=seed)
        calls = r.choices[0].message.tool_calls
        assert [c.function.name for c in calls] == ["book_table"] * len(calls)
        assert_valid_calls(calls)  # (more calls may follow until max_tokens: parallel calls)


def test_required_tool_call_one_at_a_time(client):
    r = chat(
        client, HELLO, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=160, seed=5,
    )  # fmt: skip
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(calls)


def test_forced_tool_call_streams(client):
    named = {"type": "function", "function": {"name": "book_table"}}
    stream = chat(
        client, HELLO, tools=TOOLS, tool_choice=named, max_tokens=160, seed=7, stream=True
    )
    args = {}
    for chunk in stream:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            args[delta.index] = args.get(delta.index, "") + (delta.function.arguments or "")
    assert args
    for text in args.values():
        jsonschema.validate(json.loads(text), BOOKING["parameters"])


def test_auto_is_text_or_valid_calls(client):
    r = chat(client, WEATHER, tools=TOOLS, max_tokens=160, temperature=0)
    assert_valid_calls(r.choices[0].message.tool_calls)  # the memorised call
    for seed in range(3):
        r = chat(client, HELLO, tools=TOOLS, max_tokens=160, seed=seed, temperature=1.5)
        message = r.choices[0].message
        if message.tool_calls:
            assert_valid_calls(message.tool_calls)
        else:
            assert "<tool_call>" not in (message.content or "")


# ---------------------------------------------------------------- Anthropic

CLAUDE_TOOLS = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]  # fmt: skip


def test_anthropic_tool_choice_tool_and_any(claude):
    one = {"disable_parallel_tool_use": True}
    for choice in ({"type": "tool", "name": "book_table", **one}, {"type": "any", **one}):
        m = claude.messages.create(
            model=MODEL, max_tokens=160, messages=HELLO, tools=CLAUDE_TOOLS, tool_choice=choice
        )
        uses = [b for b in m.content if b.type == "tool_use"]
        assert len(uses) == 1 and m.stop_reason == "tool_use"
        for use in uses:
            jsonschema.validate(use.input, PARAMETERS[use.name])
        if choice["type"] == "tool":
            assert {u.name for u in uses} == {"book_table"}


def test_anthropic_forced_tool_streams(claude):
    with claude.messages.stream(
        model=MODEL, max_tokens=160, messages=HELLO, tools=CLAUDE_TOOLS,
        tool_choice={"type": "tool", "name": "book_table", "disable_parallel_tool_use": True},
    ) as stream:  # fmt: skip
        message = stream.get_final_message()
    (use,) = [b for b in message.content if b.type == "tool_use"]
    jsonschema.validate(use.input, BOOKING["parameters"])


def test_anthropic_bad_input_schema_is_a_400(claude):
    bad = [{"name": "f", "input_schema": {"type": "object", "not": {"required": ["a"]}}}]
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(
            model=MODEL, max_tokens=10, messages=HELLO, tools=bad, tool_choice={"type": "any"}
        )
    assert "not" in err.value.body["error"]["message"]
