"""The Anthropic Messages API through the official `anthropic` client, against a real server."""

from __future__ import annotations

import anthropic
import httpx
import pytest
from tiny_server import (
    API_KEY,
    HELLO_A,
    HELLO_Q,
    MODEL,
    WEATHER_Q,
    WEATHER_TOOL,
    engine_for,
    serving,
)

from astrai.config import ServeConfig

HELLO = [{"role": "user", "content": HELLO_Q}]
WEATHER = [{"role": "user", "content": WEATHER_Q}]
TOOLS = [
    {
        "name": WEATHER_TOOL["name"],
        "description": WEATHER_TOOL["description"],
        "input_schema": WEATHER_TOOL["parameters"],
    }
]


@pytest.fixture(scope="module")
def server(tiny):
    with (
        engine_for(tiny, max_batch=8) as engine,
        serving(engine, ServeConfig(api_key=API_KEY)) as url,
    ):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key=API_KEY, max_retries=0)


# Newer clients dropped the sampling arguments from their signatures; the API still takes them.
SAMPLING = ("temperature", "top_p", "top_k")


def with_sampling(kwargs: dict) -> dict:
    sampling = {k: kwargs.pop(k) for k in SAMPLING if k in kwargs}
    return {**kwargs, "extra_body": sampling} if sampling else kwargs


def create(client, messages=HELLO, max_tokens=40, **kwargs):
    kwargs = with_sampling(kwargs)
    return client.messages.create(model=MODEL, max_tokens=max_tokens, messages=messages, **kwargs)


def stream(client, messages=HELLO, max_tokens=40, **kwargs):
    kwargs = with_sampling(kwargs)
    return client.messages.stream(model=MODEL, max_tokens=max_tokens, messages=messages, **kwargs)


def sse_events(url: str, body: dict) -> list[tuple[str, str]]:
    """(event, data) pairs of a raw stream, pings included (the SDK hides them)."""
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", url + "/v1/messages", json=body, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    return [
        (lines[k].removeprefix("event: "), lines[k + 1].removeprefix("data: "))
        for k in range(0, len(lines), 2)
    ]


def test_message(client):
    m = create(client, temperature=0)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == HELLO_A
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    assert m.usage.output_tokens > 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 0


def test_system_blocks_metadata_and_sampling(client):
    m = create(
        client,
        system=[{"type": "text", "text": "Be brief."}],
        metadata={"user_id": "u1"},
        temperature=0.5,
        top_p=0.9,
        top_k=10,
        max_tokens=3,
    )
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_stop_sequence(client):
    m = create(client, temperature=0, stop_sequences=["weather", "zzz"])
    assert m.content[0].text == "Hello! The "
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "weather"


def test_stream_event_sequence(server):
    body = {"model": MODEL, "max_tokens": 40, "messages": HELLO, "stream": True, "temperature": 0}
    events = sse_events(server[0], body)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-4:] == [
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert '"stop_reason":"end_turn"' in events[-2][1]


def test_stream_through_the_sdk(client):
    with stream(client, temperature=0, stop_sequences=["nice"]) as events:
        text = "".join(events.text_stream)
        final = events.get_final_message()
    assert text == "Hello! The weather is "
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "nice"
    assert final.usage.output_tokens > 0


def test_tool_use(client):
    m = create(client, WEATHER, tools=TOOLS, temperature=0, max_tokens=60)
    assert m.stop_reason == "tool_use"
    (block,) = m.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert block.name == "get_weather" and block.input == {"city": "Paris"}


def test_tool_use_streamed(client, server):
    with stream(client, WEATHER, 60, tools=TOOLS, temperature=0) as events:
        final = events.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", {"city": "Paris"})
    ]
    body = {"model": MODEL, "max_tokens": 60, "messages": WEATHER, "tools": TOOLS, "stream": True}
    names = [name for name, _ in sse_events(server[0], {**body, "temperature": 0})]
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_tool_choice(client):
    m = create(
        client,
        WEATHER,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        temperature=0,
        max_tokens=60,
    )
    assert m.content[-1].type == "tool_use" and m.content[-1].input == {"city": "Paris"}
    m = create(client, WEATHER, tools=TOOLS, tool_choice={"type": "none"}, max_tokens=4)
    assert m.content and all(b.type == "text" for b in m.content)
    with pytest.raises(anthropic.BadRequestError):
        create(client, WEATHER, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"})


def test_tool_result_round_trip(client):
    messages = [
        *WEATHER,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    m = create(client, messages, tools=TOOLS, max_tokens=4)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_count_tokens(client):
    count = client.messages.count_tokens(model=MODEL, messages=HELLO)
    m = create(client, temperature=0)
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_errors(client, server):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-x", max_tokens=5, messages=HELLO)
    with pytest.raises(anthropic.BadRequestError) as err:
        create(client, max_tokens=5_000)
    assert "max_tokens" in err.value.message
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError) as err:
        create(client, [{"role": "user", "content": [image]}])
    assert "messages[0].content[0]" in err.value.message
    with pytest.raises(anthropic.BadRequestError):
        create(client, temperature=1.5)
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    r = httpx.post(
        server[0] + "/v1/messages", json={"model": MODEL, "messages": HELLO}, headers=headers
    )
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]


def test_authentication(server):
    wrong = anthropic.Anthropic(base_url=server[0], api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        create(wrong)
    assert err.value.body["error"]["type"] == "authentication_error"


def test_models_for_the_anthropic_client(client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.type == "model"


def test_assistant_prefill_is_continued(client):
    prefill = [*HELLO, {"role": "assistant", "content": "Hello! The"}]
    m = create(client, prefill, temperature=0)
    assert m.content[0].text == HELLO_A.removeprefix("Hello! The")
    assert m.stop_reason == "end_turn"
