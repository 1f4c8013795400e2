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


def json_response(obj, status: int = 200) -> Response:
    return Response(_encode(obj), status_code=status, media_type="application/json")
