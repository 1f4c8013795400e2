"""Beyond the waiting limit: 429 for OpenAI clients, 529 overloaded for Anthropic clients."""

from __future__ import annotations

import contextlib

import anthropic
import httpx
import openai
import pytest
from tiny_server import MODEL, engine_for, no_end_bias, serving, wait_for, wait_until_idle

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tiny):
    # one running request at a time, one more may wait
    with engine_for(tiny, max_batch=1, max_waiting=1) as engine, serving(engine) as url:
        yield url, engine


def test_overloaded(server, tiny):
    url, engine = server
    long = {
        "model": MODEL,
        "messages": HELLO,
        # as long as the context allows: both must still be generating when the last
        # request arrives, however slowly the clients start on a busy machine
        "max_tokens": 500,
        "stream": True,
        "logit_bias": no_end_bias(tiny[2]),
    }
    with contextlib.ExitStack() as streams:
        for state in ("running", "waiting"):
            r = streams.enter_context(httpx.stream("POST", url + "/v1/chat/completions", json=long))
            assert r.status_code == 200
            wait_for(engine, state, 1)
        oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as err:
            oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert err.value.status_code == 429
        an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.OverloadedError) as err:
            an.messages.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert err.value.body["error"]["type"] == "overloaded_error"
    stats = wait_until_idle(engine)
    assert stats.pages_used == 0 and stats.running == 0
    # and once the queue drains, requests are served again
    oa.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
