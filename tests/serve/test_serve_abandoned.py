"""A client that leaves before its (non-streamed) answer is ready cancels the generation, and
the pages come back: the server does not generate to max_tokens for nobody."""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest
from tiny_server import HELLO_Q, MODEL, engine_for, serving, wait_for, wait_until_idle

MAX_TOKENS = 400


class Endless:
    """The engine, with generation that never stops on its own (only max_tokens ends it), so
    that a request is still running when its client leaves, in either API."""

    def __init__(self, engine):
        self.engine = engine

    def astream(self, prompt, sampling=None, **fields):
        return self.engine.astream(prompt, sampling, **{**fields, "ignore_eos": True})

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture(scope="module")
def server(tiny):
    with engine_for(tiny, max_batch=4) as engine, serving(Endless(engine)) as url:
        yield url, engine


REQUESTS = {
    "openai": ("/v1/chat/completions", {}),
    "anthropic": ("/v1/messages", {"anthropic-version": "2023-06-01"}),
}


def send_and_leave(url: str, path: str, headers: dict, body: dict, engine) -> None:
    """POST over a plain socket, wait until the engine runs the request, close the socket."""
    address = urlsplit(url)
    data = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"Host: {address.netloc}", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in headers.items()] + [f"Content-Length: {len(data)}"]
    with socket.create_connection((address.hostname, address.port)) as client:
        client.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        wait_for(engine, "running", 1)


@pytest.mark.parametrize("api", list(REQUESTS))
def test_an_abandoned_request_is_cancelled_and_its_pages_freed(server, api):
    url, engine = server
    before = wait_until_idle(engine)
    path, headers = REQUESTS[api]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": HELLO_Q}],
        "max_tokens": MAX_TOKENS,
    }
    send_and_leave(url, path, headers, body, engine)
    wait_for(engine, "requests_aborted", before.requests_aborted + 1)
    stats = wait_until_idle(engine)
    assert stats.running == 0 and stats.pages_used == 0
    assert stats.completion_tokens - before.completion_tokens < MAX_TOKENS  # cut short
