"""Request validation names the field; errors render in each API's format; metrics render."""

from __future__ import annotations

import msgspec
import pytest

from astrai.serve.errors import (
    APIError,
    anthropic_body,
    anthropic_status,
    from_decode_error,
    openai_body,
    overloaded,
)
from astrai.serve.metrics import Metrics, count_request, observe, render
from astrai.serve.schemas_anthropic import MessagesRequest
from astrai.serve.schemas_openai import ChatRequest, CompletionRequest


def error_for(struct, body: bytes) -> APIError:
    with pytest.raises(msgspec.DecodeError) as exc:
        msgspec.json.decode(body, type=struct)
    return from_decode_error(exc.value)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model": "m", "messages": [], "temperature": 3}', "messages"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}',
            "temperature",
        ),
        (b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}', "n"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}',
            "logit_bias",
        ),
    ],
)
def test_chat_errors_name_the_field(body, param):
    err = error_for(ChatRequest, body)
    assert err.status == 400 and err.param == param and param in err.message


def test_malformed_json_is_a_400():
    err = error_for(ChatRequest, b'{"model": ')
    assert err.status == 400 and err.code == "invalid_json"


def test_completion_suffix_is_refused():
    err = error_for(CompletionRequest, b'{"model": "m", "prompt": "x", "suffix": "y"}')
    assert err.param == "suffix"


def test_anthropic_block_errors():
    body = b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}'
    err = error_for(MessagesRequest, body)
    assert err.param == "messages[0].content[0].type"
    err = error_for(
        MessagesRequest, b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}'
    )
    assert err.param == "max_tokens"


def test_error_bodies():
    err = APIError(400, "temperature: too hot", "temperature")
    assert openai_body(err) == {
        "error": {
            "message": "temperature: too hot",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }
    assert anthropic_body(err) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "temperature: too hot"},
    }
    busy = overloaded("full")
    assert busy.status == 429 and anthropic_status(busy) == 529
    assert anthropic_body(busy)["error"]["type"] == "overloaded_error"


def test_metrics_text():
    metrics = Metrics()
    count_request(metrics, "/v1/messages", 200)
    observe(metrics.time_to_first_token, 0.02)
    observe(metrics.inter_token_latency, 0.004, times=3)
    text = render(metrics, {"running": 2, "prefix_cache_hit_rate": 0.5, "note": "x"})
    assert 'astrai_requests_total{route="/v1/messages",status="200"} 1' in text
    assert 'astrai_time_to_first_token_seconds_bucket{le="0.025"} 1' in text
    assert 'astrai_time_to_first_token_seconds_bucket{le="+Inf"} 1' in text
    assert "astrai_inter_token_latency_seconds_count 3" in text
    assert "astrai_running 2" in text and "astrai_prefix_cache_hit_rate 0.5" in text
    assert "note" not in text
