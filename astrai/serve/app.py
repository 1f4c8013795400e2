"""The Starlette app: routes, API keys, body limits, and errors in each API's own format.

Every route goes through `_endpoint`: it checks the API key (except /health), reads a POST body
up to the size limit, and turns any error into the JSON the client's SDK understands. Model and
tokenizer are loaded before the app exists; the one route whose body names a file is POST
/v1/adapters, which reads the LoRA adapter folder an authorised client names (it opens only
adapter_config.json and adapter_model.safetensors there).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
from collections.abc import Awaitable, Callable

import msgspec
import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from astrai.config import ServeConfig
from astrai.serve import (
    adapter_endpoints,
    anthropic,
    chat_completions,
    completions,
    embeddings,
    models,
)
from astrai.serve.bodies import json_response
from astrai.serve.errors import (
    APIError,
    anthropic_body,
    anthropic_status,
    openai_body,
    openai_status,
)
from astrai.serve.metrics import Metrics, count_request, render, speculation_summary
from astrai.serve.page import page_routes
from astrai.serve.state import AppState, now

log = logging.getLogger("astrai.serve")
_encode = msgspec.json.Encoder().encode

Handler = Callable[[AppState, object], Awaitable[Response]]


def speaks_anthropic(request: Request) -> bool:
    # the Anthropic SDK sends anthropic-version on every call, e.g. GET /v1/models
    return request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers


def error_response(request: Request, err: APIError) -> Response:
    if speaks_anthropic(request):
        status, body = anthropic_status(err), anthropic_body(err)
    else:
        status, body = openai_status(err), openai_body(err)
    return Response(_encode(body), status_code=status, media_type="application/json")


def authorize(request: Request, api_key: str | None) -> None:
    """Either header may carry the key: `Authorization: Bearer` (OpenAI) or `x-api-key`."""
    if api_key is None:
        return
    bearer = request.headers.get("authorization", "")
    offered = [bearer[7:].strip()] if bearer[:7].lower() == "bearer " else []
    offered += [request.headers["x-api-key"]] if "x-api-key" in request.headers else []
    if not any(hmac.compare_digest(k.encode(), api_key.encode()) for k in offered):
        message = "Invalid API key." if offered else "An API key is required."
        raise APIError(401, message, code="invalid_api_key")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    too_large = APIError(413, f"The request body is larger than {limit} bytes.")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "The client went away while sending the body.") from None
    return b"".join(chunks)


# Deeper JSON than any request needs (a tool's JSON schema nests a few levels) would make the
# decoder and the chat template recurse until Python's recursion limit: refuse it first.
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(body: bytes) -> int:
    """How deeply arrays and objects nest in `body` (brackets inside strings do not count)."""
    brackets = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)
    steps = np.isin(brackets, (ord("["), ord("{"))).astype(np.int64)
    steps -= np.isin(brackets, (ord("]"), ord("}")))
    return int(np.cumsum(steps).max(initial=0))


def check_json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> None:
    if json_depth(body) > limit:
        raise APIError(400, f"The request body nests JSON more than {limit} levels deep.")


async def until_disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body must have been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_abandoned(request: Request, answer: Awaitable[Response]) -> Response:
    """`answer`, or, when the client disconnects first, cancel it: the cancellation reaches
    the engine streams it waits on, which cancel their requests and free their pages. (A
    streamed answer returns at once; its stream watches for the disconnect itself.)"""
    answering = asyncio.ensure_future(answer)
    watching = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({answering, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not answering.done():
            answering.cancel()
        await asyncio.gather(watching, answering, return_exceptions=True)
    if answering.cancelled():  # nobody is left to read an answer; this one is for the logs
        raise APIError(499, "The client closed the connection before the answer was ready.")
    return answering.result()


def _endpoint(state: AppState, path: str, handler: Handler, public: bool = False):
    """POST handlers receive the body bytes, GET and DELETE handlers the request."""

    async def endpoint(request: Request) -> Response:
        try:
            if not public:
                authorize(request, state.serve_cfg.api_key)
            if request.method == "POST":
                body = await read_body(request, state.serve_cfg.max_body_bytes)
                check_json_depth(body)
                response = await unless_abandoned(request, handler(state, body))
            else:
                response = await handler(state, request)
        except APIError as err:
            response = error_response(request, err)
        except Exception:  # a bug of ours: say so, keep serving
            log.exception("error while answering %s", path)
            response = error_response(request, APIError(500, "Internal server error."))
        count_request(state.metrics, path, response.status_code)
        return response

    return endpoint


# ---------------------------------------------------------------- the small GET routes
# (/v1/models and /v1/models/{id} are in models.py)


async def health(state: AppState, request: Request) -> Response:
    return json_response({"status": "ok", "model": state.model_name})


def engine_stats_of(state: AppState) -> dict:
    """The engine's stats with the speculative counts' rates (speculation_summary)."""
    stats = msgspec.structs.asdict(state.engine.stats())
    return {**stats, **speculation_summary(stats)}


async def stats(state: AppState, request: Request) -> Response:
    """The engine's stats, and the ids of the requests being answered (oldest first)."""
    return json_response(
        {**engine_stats_of(state), "open_requests": list(state.metrics.open_requests)}
    )


async def metrics(state: AppState, request: Request) -> Response:
    text = render(state.metrics, engine_stats_of(state))
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


# ---------------------------------------------------------------- the app


def context_of(engine) -> int:
    limit = getattr(engine, "max_seq_len", None)
    return limit or engine.cfg.max_position_embeddings


def make_app(engine, model_name: str, serve_cfg: ServeConfig | None = None) -> Starlette:
    """An app serving `engine` (an `astrai.infer.Engine`, or an `EncoderModel` for embeddings)
    under `model_name`. The caller owns the engine and closes it after the server stops."""
    serve_cfg = serve_cfg or ServeConfig()
    state = AppState(
        engine=engine,
        tokenizer=engine.tokenizer,
        model_name=model_name,
        context=context_of(engine),
        vocab_size=engine.cfg.vocab_size,
        serve_cfg=serve_cfg,
        metrics=Metrics(),
        created=now(),
    )
    table = [
        ("/v1/chat/completions", "POST", chat_completions.chat_completions, False),
        ("/v1/completions", "POST", completions.completions, False),
        ("/v1/embeddings", "POST", embeddings.embeddings, False),
        ("/v1/messages", "POST", anthropic.messages, False),
        ("/v1/messages/count_tokens", "POST", anthropic.count_tokens, False),
        ("/v1/models", "GET", models.list_models, False),
        ("/v1/models/{model_id:path}", "GET", models.get_model, False),
        ("/v1/adapters", "POST", adapter_endpoints.load_adapter, False),
        ("/v1/adapters/{name}", "DELETE", adapter_endpoints.unload_adapter, False),
        ("/health", "GET", health, True),
        ("/stats", "GET", stats, False),
        ("/metrics", "GET", metrics, False),
    ]
    routes = [
        Route(path, _endpoint(state, path, handler, public), methods=[method])
        for path, method, handler, public in table
    ]

    async def http_error(request: Request, exc: HTTPException) -> Response:
        # unknown paths and wrong methods, in the same format as every other error
        return error_response(
            request, APIError(exc.status_code, f"{exc.detail}: {request.url.path}")
        )

    routes += page_routes()  # the chat page at /, which needs no key
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.state.astrai = state
    return app
