"""Whatever a client sends, the answer is a success or a 4xx in the API's format, never a 500;
a body the schema forbids is never a 200; and nothing is left running or holding pages."""

from __future__ import annotations

import json
from collections import Counter

import httpx
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_fuzz import invalid, risky, valid
from tiny_server import MODEL, engine_for, serving, wait_until_idle

from astrai.config import ServeConfig
from astrai.serve.schemas_anthropic import MessageResponse, MessagesRequest
from astrai.serve.schemas_openai import (
    ChatCompletion,
    ChatRequest,
    CompletionRequest,
    TextCompletion,
    TextPart,
)

SETTINGS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
anything = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
names = st.text("abcdefgh_", min_size=1, max_size=6)
words = st.text('ab <|>{}"\\/é\n', max_size=12)


def corrupted(valid: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    """A valid body with one key dropped or set to anything at all."""

    def corrupt(body: dict, key: str, value, drop: bool) -> dict:
        body = dict(body)
        if drop:
            body.pop(key, None)
        else:
            body[key] = value
        return body

    keys = st.sampled_from(["model", "messages", "max_tokens", "n", "stop", "tools", "prompt", "x"])
    return st.builds(corrupt, valid, keys, anything, st.booleans())


def bodies(valid: st.SearchStrategy[dict]) -> st.SearchStrategy:
    return valid | corrupted(valid) | anything


openai_sampling = {
    "max_tokens": st.integers(1, 8),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "stop": words | st.lists(words, max_size=3),
    "seed": st.integers(0, 2**63 - 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 399).map(str), st.floats(-100, 100), max_size=2),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": words,
}
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": words})
chat_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]),
        "content": words | st.lists(text_part, max_size=2),
    }
)
openai_tool = st.fixed_dictionaries(
    {
        "type": st.just("function"),
        "function": st.fixed_dictionaries({"name": names}, optional={"parameters": st.just({})}),
    }
)
valid_chat = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(chat_message, min_size=1, max_size=3)},
    optional={
        **openai_sampling,
        "max_completion_tokens": st.integers(1, 8),
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(0, 5),
        "tools": st.lists(openai_tool, max_size=2),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
    },
)
valid_completion = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": words
        | st.lists(words, min_size=1, max_size=2)
        | st.lists(st.integers(0, 399), min_size=1, max_size=5),
    },
    optional={**openai_sampling, "echo": st.booleans(), "logprobs": st.integers(0, 5)},
)

BLOCKS = {
    "text": st.fixed_dictionaries({"type": st.just("text"), "text": words}),
    "tool_use": st.fixed_dictionaries(
        {"type": st.just("tool_use"), "id": names, "name": names, "input": st.just({"a": 1})}
    ),
    "tool_result": st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": names},
        optional={"content": words | st.lists(st.just({"type": "text", "text": "r"}), max_size=2)},
    ),
}
block = st.one_of(list(BLOCKS.values()))
anthropic_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]),
        "content": words | st.lists(block, min_size=1, max_size=3),
    }
)
valid_messages = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "max_tokens": st.integers(1, 8),
        "messages": st.lists(anthropic_message, min_size=1, max_size=3),
    },
    optional={
        "system": words | st.lists(st.just({"type": "text", "text": "be brief"}), max_size=2),
        "stop_sequences": st.lists(words, max_size=3),
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(0, 50),
        "metadata": st.just({"user_id": "u"}),
        "stream": st.booleans(),
        "tools": st.lists(
            st.fixed_dictionaries({"name": names, "input_schema": st.just({"type": "object"})}),
            max_size=2,
        ),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}]),
    },
)


@pytest.fixture(scope="module")
def server(tiny):
    cfg = ServeConfig(default_max_tokens=8, max_n=3, max_body_bytes=20_000)
    with (
        engine_for(tiny, max_batch=8) as engine,
        serving(engine, cfg) as url,
        httpx.Client(base_url=url, timeout=60) as http,
    ):
        yield http, engine


def post(http: httpx.Client, path: str, body) -> httpx.Response:
    # json.dumps writes NaN and Infinity, which strict JSON parsers must refuse
    return http.post(
        path, content=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )


SENT: Counter = Counter()  # requests sent per kind of body, reported by the last test


def check(response: httpx.Response, anthropic: bool) -> None:
    SENT["total"] += 1
    assert response.status_code < 500, response.text
    if response.status_code == 200:
        return
    body = response.json()
    if anthropic:
        assert body["type"] == "error" and body["error"]["message"]
    else:
        assert body["error"]["message"] and body["error"]["type"]


@SETTINGS
@given(body=bodies(valid_chat))
def test_chat_completions(server, body):
    check(post(server[0], "/v1/chat/completions", body), anthropic=False)


@SETTINGS
@given(body=bodies(valid_completion))
def test_completions(server, body):
    check(post(server[0], "/v1/completions", body), anthropic=False)


@SETTINGS
@given(body=bodies(valid_messages))
def test_messages(server, body):
    check(post(server[0], "/v1/messages", body), anthropic=True)


@SETTINGS
@given(raw=st.binary(max_size=64), path=st.sampled_from(["/v1/chat/completions", "/v1/messages"]))
def test_raw_bytes(server, raw, path):
    check(server[0].post(path, content=raw), anthropic=path == "/v1/messages")


def test_embeddings_on_a_decoder_and_no_pages_left(server):
    http, engine = server
    r = http.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    stats = wait_until_idle(engine)
    assert stats.pages_used == 0 and stats.requests_failed == 0


# ---------------------------------------------------------------- bodies drawn from the schemas

# Fields the server checks beyond the schema, steered so that most valid bodies succeed.
small = st.integers(1, 4)
byte_ids = st.integers(0, 255)  # token ids every byte-level vocabulary holds
OPENAI_STEERING = {
    "model": st.just(MODEL),
    "max_tokens": small,
    "max_completion_tokens": small,
    "n": st.integers(1, 3),
    "top_logprobs": st.integers(0, 5),
    "logit_bias": st.dictionaries(byte_ids.map(str), st.floats(-100, 100), max_size=2),
    # a message's content may be left out only by an assistant turn that calls tools
    "content": valid(str | list[TextPart]),
    # constrained decoding has its own tests; several constraints at once are refused
    **dict.fromkeys(
        ["structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"],
        st.none(),
    ),
}
nonempty = st.text('ab <|>{}"\\/é\n', min_size=1, max_size=12)
COMPLETION_STEERING = {
    **OPENAI_STEERING,
    "logprobs": st.none() | st.integers(0, 5),
    # one prompt: n choices of it stay within the server's max_n
    "prompt": nonempty
    | st.lists(nonempty, min_size=1, max_size=1)
    | st.lists(byte_ids, min_size=1, max_size=5),
}
# tool_use blocks are the assistant's, tool_result blocks the user's
turns = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.just("user"),
            "content": nonempty
            | st.lists(st.one_of(BLOCKS["text"], BLOCKS["tool_result"]), min_size=1, max_size=2),
        }
    )
    | st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": nonempty
            | st.lists(st.one_of(BLOCKS["text"], BLOCKS["tool_use"]), min_size=1, max_size=2),
        }
    ),
    min_size=1,
    max_size=3,
)
ANTHROPIC_STEERING = {"model": st.just(MODEL), "max_tokens": small, "messages": turns}
# (path, request schema, response schema, steering, always-given fields, anthropic?)
ENDPOINTS = {
    "chat": ("/v1/chat/completions", ChatRequest, ChatCompletion, OPENAI_STEERING, {"content"}),
    "completions": ("/v1/completions", CompletionRequest, TextCompletion, COMPLETION_STEERING, ()),
    "messages": ("/v1/messages", MessagesRequest, MessageResponse, ANTHROPIC_STEERING, ()),
}
FUZZ = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def check_answer(response: httpx.Response, endpoint: str, body) -> None:
    """A 4xx in the API's own format, or a 200 whose body is a valid answer."""
    anthropic = endpoint == "messages"
    check(response, anthropic)
    if response.status_code != 200:
        return
    SENT["200"] += 1
    if isinstance(body, dict) and body.get("stream") is True:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        if anthropic:  # event lines name each event; a failure would be `event: error`
            assert "event: error" not in response.text and "event: message_stop" in response.text
        else:  # a failure would be a data event holding {"error": ...}
            assert not any(e.startswith('data: {"error"') for e in events), response.text
            assert events[-1] == "data: [DONE]"
    else:
        msgspec.json.decode(response.content, type=ENDPOINTS[endpoint][2])


def fuzz_post(http: httpx.Client, endpoint: str, body) -> httpx.Response:
    path = ENDPOINTS[endpoint][0]
    headers = {"anthropic-version": "2023-06-01"} if endpoint == "messages" else {}
    return http.post(path, content=json.dumps(body).encode(), headers=headers)


def strategy(make, endpoint: str):
    _, schema, _, steering, always = ENDPOINTS[endpoint]
    return make(schema, steering, frozenset(always))


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_valid_bodies_from_the_schema(server, endpoint):
    @FUZZ
    @given(body=strategy(valid, endpoint))
    def run(body):
        SENT["valid"] += 1
        response = fuzz_post(server[0], endpoint, body)
        check_answer(response, endpoint, body)
        answered.append(response.status_code == 200)

    answered = []
    run()
    # the steering keeps most valid bodies within what the server accepts: their answers,
    # not only refusals, are checked
    assert sum(answered) >= len(answered) / 2, f"{sum(answered)} of {len(answered)} answered"


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_bodies_the_schema_forbids_are_refused(server, endpoint):
    @settings(FUZZ, max_examples=60)
    @given(broken=strategy(invalid, endpoint))
    def run(broken):
        body, what = broken
        SENT["invalid"] += 1
        response = fuzz_post(server[0], endpoint, body)
        check(response, endpoint == "messages")
        assert 400 <= response.status_code < 500, (what, response.text)

    run()


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_huge_values_are_answered_or_refused(server, endpoint):
    @settings(FUZZ, max_examples=25)
    @given(changed=strategy(risky, endpoint))
    def run(changed):
        body, _ = changed
        SENT["huge"] += 1
        check_answer(fuzz_post(server[0], endpoint, body), endpoint, body)

    run()


DEEP = "DEEP"  # stands for 5000 nested arrays: more than json.dumps (or msgspec) can recurse
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": [USER], "extra": DEEP}, None),
        (
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [USER],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}],
            },
            None,
        ),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 4, "messages": [USER], "metadata": DEEP},
            None,
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, "messages[0]"),
        (
            "/v1/messages",
            {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": []}]},
            "messages[0].content",
        ),
    ],
    ids=["deep-extra", "deep-tool-parameters", "deep-metadata", "no-content", "empty-content"],
)
def test_deep_nesting_and_missing_content_are_400(server, path, body, param):
    raw = json.dumps(body).replace(f'"{DEEP}"', "[" * 5000 + "]" * 5000)
    response = server[0].post(
        path, content=raw.encode(), headers={"content-type": "application/json"}
    )
    check(response, path == "/v1/messages")
    assert response.status_code == 400, response.text
    if path != "/v1/messages":
        assert response.json()["error"]["param"] == param
    else:
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_zzz_nothing_is_left_running_after_all_of_them(server):
    """Last in this module: after every request above, the engine is idle and holds no pages."""
    http, engine = server
    stats = wait_until_idle(engine)
    assert stats.running == stats.waiting == stats.pages_used == 0, stats
    assert stats.requests_failed == 0
    assert http.get("/stats").json()["pages_used"] == 0
    print(f"\nrequests sent: {dict(SENT)}")
