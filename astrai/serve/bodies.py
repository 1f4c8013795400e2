"""JSON bodies in and out: a request body decoded into its Struct (or a 400 naming the field at
fault), a response Struct encoded."""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from astrai.serve.errors import from_decode_error

_encode = msgspec.json.Encoder().encode


def decode_body(decoder: msgspec.json.Decoder, body: bytes):
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise from_decode_error(exc) from None


def id_headers(request_id: str | None) -> dict[str, str] | None:
    """A request's id where each API's client reads it (OpenAI's `x-request-id`, Anthropic's
    `request-id`): the id of the response body and of the engine's requests."""
    return None if request_id is None else {"x-request-id": request_id, "request-id": request_id}


def json_response(obj, status: int = 200, request_id: str | None = None) -> Response:
    body, headers = _encode(obj), id_headers(request_id)
    return Response(body, status_code=status, headers=headers, media_type="application/json")
