"""Errors a client caused (or the server could not help), and how each API writes them.

Handlers raise `APIError`; the app turns it into the JSON body and status of the API the client
spoke: OpenAI's `{"error": {...}}` or Anthropic's `{"type": "error", "error": {...}}`.
"""

from __future__ import annotations

import re

import msgspec


class APIError(Exception):
    """An HTTP error with a message for people; `param` names the request field at fault."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def overloaded(message: str) -> APIError:
    # OpenAI clients know 429; Anthropic's answer to the same condition is 529 (see below).
    return APIError(429, message, code="overloaded")


_PATH = re.compile(r" - at (`key` in )?`\$\.?([^`]*)`$")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def from_decode_error(exc: msgspec.DecodeError, where: str = "") -> APIError:
    """A msgspec error -> 400 naming the field: "Expected `float` <= 2.0 - at `$.temperature`"
    becomes "temperature: Expected `float` <= 2.0" with param "temperature"."""
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return bad_request(f"The request body is not valid JSON: {text}", code="invalid_json")
    found = _PATH.search(text)
    param = found.group(2) if found else None
    text = _PATH.sub(" (in a key)" if found and found.group(1) else "", text)
    if param is None and (missing := _MISSING.search(text)):
        param = missing.group(1)
        if where:
            param = f"{where}.{param}"
    elif param and where:
        param = f"{where}.{param}"
    return bad_request(f"{param}: {text}" if param else text, param)


_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",  # Anthropic's API has no conflicts; its SDK reads this one
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def generation_failed(reason: str | None) -> APIError:
    """An engine request that ended in an error: the server's fault, not the client's."""
    return APIError(500, f"Generation failed: {reason or 'unknown error'}")


def openai_status(err: APIError) -> int:
    return err.status


def openai_body(err: APIError) -> dict:
    kind = _OPENAI_TYPES.get(err.status, "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def anthropic_status(err: APIError) -> int:
    return 529 if err.code == "overloaded" else err.status


def anthropic_body(err: APIError) -> dict:
    kind = _ANTHROPIC_TYPES.get(anthropic_status(err), "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}
