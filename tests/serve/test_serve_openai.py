"""The OpenAI API through the official `openai` client, against a real server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from tiny_server import (
    API_KEY,
    CALL_JSON,
    HELLO_A,
    HELLO_Q,
    MODEL,
    WEATHER_Q,
    WEATHER_TOOL,
    engine_for,
    no_end_bias,
    serving,
    wait_for,
    wait_until_idle,
)

from astrai.config import ServeConfig

HELLO = [{"role": "user", "content": HELLO_Q}]
WEATHER = [{"role": "user", "content": WEATHER_Q}]
TOOLS = [{"type": "function", "function": WEATHER_TOOL}]


@pytest.fixture(scope="module")
def server(tiny):
    cfg = ServeConfig(api_key=API_KEY, default_max_tokens=32, max_n=4, max_body_bytes=64_000)
    with engine_for(tiny, max_batch=16) as engine, serving(engine, cfg) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0)


def chat(client, messages=HELLO, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs)


def test_chat_completion(client):
    r = chat(client, max_tokens=40, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and r.id.startswith("chatcmpl-")
    assert r.created > 0
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == HELLO_A
    assert choice.finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_ignore_eos_runs_to_max_tokens(client):
    stopped = chat(client, max_tokens=40, temperature=0)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 40
    r = chat(client, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40
    assert r.choices[0].message.content.startswith(HELLO_A)


def test_text_parts_and_max_completion_tokens(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": HELLO_Q}]}]
    r = chat(client, messages, max_completion_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    assert HELLO_A.startswith(r.choices[0].message.content)


def test_streaming_with_usage(client):
    stream = chat(
        client, max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == HELLO_A
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_share_the_prompt(client, server):
    engine = server[1]
    cached = engine.stats().cached_tokens
    messages = [{"role": "user", "content": "three answers to one long question, please " * 3}]
    r = chat(client, messages, n=3, max_tokens=5, temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 15
    pages = r.usage.prompt_tokens // 16  # full pages of the prompt (page_size 16)
    assert pages >= 1
    assert engine.stats().cached_tokens - cached >= 2 * 16 * pages  # choices 1 and 2 hit


def test_n_choices_streamed(client):
    stream = chat(client, n=2, max_tokens=40, temperature=0, stream=True)
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [HELLO_A, HELLO_A]


@pytest.mark.parametrize("stop", ["weather", ["nice", "weather"]])
def test_stop_sequences_never_leak(client, stop):
    r = chat(client, max_tokens=40, temperature=0, stop=stop)
    assert r.choices[0].message.content == "Hello! The "
    assert r.choices[0].finish_reason == "stop"
    stream = chat(client, max_tokens=40, temperature=0, stop=stop, stream=True)
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == "Hello! The "
    assert not any("we" in d for d in deltas)


def test_tool_call(client):
    r = chat(client, WEATHER, tools=TOOLS, max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == json.loads(CALL_JSON)["arguments"]


def test_tool_call_streamed(client):
    stream = chat(client, WEATHER, tools=TOOLS, max_tokens=60, temperature=0, stream=True)
    calls, text, finish = {}, "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert text == "" and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_named_tool_choice_and_none(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, WEATHER, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0)
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    r = chat(client, WEATHER, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError) as err:
        chat(
            client,
            WEATHER,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "x"}},
        )
    assert err.value.body["param"] == "tool_choice"


def test_assistant_tool_turns_are_accepted(client):
    messages = [
        *WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = chat(client, messages, tools=TOOLS, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_logprobs(client):
    r = chat(client, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3 and token.logprob <= 0
        assert token.top_logprobs[0].token == token.token  # greedy picks the most likely


def test_sampling_fields_accepted(client):
    r = chat(
        client,
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={"5": 1.0},
        seed=3,
        user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert r.usage.completion_tokens <= 4


def test_seed_reproduces(client, tiny):
    kwargs = {"max_tokens": 8, "temperature": 1.0, "seed": 11, "logit_bias": no_end_bias(tiny[2])}
    a, b = chat(client, **kwargs), chat(client, **kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == 8


def test_completions(client):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.usage.completion_tokens == 5 or r.choices[0].finish_reason == "stop"
    echoed = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=5, temperature=0, echo=True, logprobs=2
    )
    assert echoed.choices[0].text == "Hello" + r.choices[0].text
    # with echo, as in OpenAI's API, the log-probs cover the prompt's tokens, then the new ones
    usage, logprobs = echoed.usage, echoed.choices[0].logprobs
    assert len(logprobs.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert "".join(logprobs.tokens[: usage.prompt_tokens]) == "Hello"
    assert logprobs.token_logprobs[0] is None
    batch = client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    streamed = client.completions.create(
        model=MODEL, prompt=[1, 2, 3], max_tokens=5, temperature=0, stream=True
    )
    assert sum(1 for c in streamed for _ in c.choices) >= 1


def test_models(client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_errors_name_the_field(client, server):
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4", messages=HELLO)
    assert err.value.body["param"] == "model"
    cases = [
        ({"max_tokens": 10_000}, "max_tokens"),
        ({"max_completion_tokens": 10_000}, "max_completion_tokens"),
        ({"n": 5}, "n"),
        ({"temperature": 5}, "temperature"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            chat(client, **kwargs)
        assert err.value.status_code == 400
        assert err.value.body["param"] == field, kwargs
        assert field in err.value.body["message"]
    long_prompt = [{"role": "user", "content": "word " * 2000}]
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, long_prompt)
    assert err.value.body["code"] == "context_length_exceeded"


def test_raw_errors(server):
    url = server[0]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", headers=headers)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url + "/v1/chat/completions", content=b"x" * 70_000, headers=headers)
    assert r.status_code == 413
    r = httpx.get(url + "/v1/nowhere", headers=headers)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(url + "/v1/chat/completions", headers=headers)
    assert r.status_code == 405


def test_authentication(server):
    url = server[0]
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        chat(wrong)
    assert httpx.get(url + "/stats").status_code == 401
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_metrics_and_stats(server):
    url, _ = server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = httpx.get(url + "/metrics", headers=headers).text
    for name in (
        "astrai_requests_total",
        "astrai_generation_tokens_total",
        "astrai_time_to_first_token_seconds_bucket",
        "astrai_inter_token_latency_seconds_count",
        "astrai_running",
        "astrai_waiting",
        "astrai_pages_used",
        "astrai_prefix_cache_hit_rate",
    ):
        assert name in text
    stats = httpx.get(url + "/stats", headers=headers).json()
    assert {"running", "waiting", "pages_used"} <= set(stats)


@pytest.mark.parametrize(("n", "lines_read"), [(1, 6), (2, 8), (1, 0)])
def test_disconnect_mid_stream_frees_pages(server, tiny, n, lines_read):
    url, engine = server
    before = wait_until_idle(engine)
    body = {
        "model": MODEL,
        "messages": HELLO,
        "max_tokens": 400,
        "n": n,
        "stream": True,
        "logit_bias": no_end_bias(tiny[2]),
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        lines = r.iter_lines()
        for _ in range(lines_read):
            next(lines)
        wait_for(engine, "running", n)
    stats = wait_until_idle(engine)
    assert stats.pages_used == 0 and stats.running == 0
    assert stats.requests_aborted == before.requests_aborted + n
    assert stats.completion_tokens - before.completion_tokens < 400 * n  # cut short
