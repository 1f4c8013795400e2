"""One id follows a request end to end: the response's id (body and header, as each client
reads it) names the engine's requests and their events, the request in /stats while it is
answered, and its log line."""

from __future__ import annotations

import logging
import threading
import time

import anthropic
import anyio
import httpx
import openai
import pytest
from tiny_server import HELLO_Q, MODEL, engine_for, serving

HELLO = [{"role": "user", "content": HELLO_Q}]


class Recorded:
    """An engine stream that notes the request id of every event it hands out; after the
    first, it waits for `release` when one is given."""

    def __init__(self, events, seen: list[str], release: threading.Event | None):
        self.events, self.seen, self.release, self.read = events, seen, release, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.read and self.release is not None:
            await anyio.to_thread.run_sync(self.release.wait)
        event = await anext(self.events)
        self.seen.append(event.request_id)
        self.read += 1
        return event

    def at_hand(self) -> bool:
        return self.events.at_hand()

    async def aclose(self) -> None:
        await self.events.aclose()


class Recording:
    """The engine, with the request ids of all the events it sent."""

    def __init__(self, engine):
        self.engine, self.seen, self.release = engine, [], None

    def astream(self, prompt, sampling=None, **fields):
        return Recorded(self.engine.astream(prompt, sampling, **fields), self.seen, self.release)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def server(tiny):
    with engine_for(tiny) as engine:
        recording = Recording(engine)
        with serving(recording) as url:
            yield url, recording


@pytest.fixture
def logged(caplog):
    caplog.set_level(logging.INFO, logger="astrai.serve")
    return caplog


def log_lines(caplog, request_id: str, timeout: float = 10.0) -> list[str]:
    """The log lines naming request_id, once there is one: the server writes a request's line
    when its response has ended, which a client reading a stream may see first."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)


def test_a_chat_completion_is_one_id_from_header_to_engine_and_log(server, logged):
    url, engine = server
    engine.seen.clear()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HELLO, max_tokens=8
    )
    completion = raw.parse()
    assert completion.id.startswith("chatcmpl-")
    assert raw.headers["x-request-id"] == completion.id == completion._request_id
    assert engine.seen and set(engine.seen) == {completion.id}
    (line,) = log_lines(logged, completion.id)
    assert f"{completion.usage.completion_tokens} generated" in line


def test_the_choices_of_a_stream_are_named_after_its_id(server, logged):
    url, engine = server
    engine.seen.clear()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=HELLO, max_tokens=4, n=2, stream=True
    ) as response:
        request_id = response.headers["x-request-id"]
        ids = {chunk.id for chunk in response.parse()}
    assert ids == {request_id}
    assert set(engine.seen) == {f"{request_id}-0", f"{request_id}-1"}
    assert len(log_lines(logged, request_id)) == 1


def test_a_message_is_one_id_from_header_to_engine_and_log(server, logged):
    url, engine = server
    engine.seen.clear()
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    message = client.messages.create(model=MODEL, messages=HELLO, max_tokens=8)
    assert message.id.startswith("msg_") and message._request_id == message.id
    assert set(engine.seen) == {message.id}
    assert len(log_lines(logged, message.id)) == 1


def test_stats_list_a_request_while_it_is_answered(server):
    url, engine = server
    engine.release = threading.Event()  # the stream stops after its first token until set
    body = {"model": MODEL, "prompt": "Say", "max_tokens": 8, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body) as response:
            request_id = response.headers["x-request-id"]
            assert request_id in httpx.get(url + "/stats").json()["open_requests"]
            engine.release.set()
            assert response.read().endswith(b"data: [DONE]\n\n")
    finally:
        engine.release.set()
        engine.release = None
    deadline = time.monotonic() + 5  # the server closes the request after its last write
    while request_id in httpx.get(url + "/stats").json()["open_requests"]:
        assert time.monotonic() < deadline
