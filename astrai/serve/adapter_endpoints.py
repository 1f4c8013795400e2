"""Loading and unloading LoRA adapters while serving: POST /v1/adapters {"name", "path"} and
DELETE /v1/adapters/{name}, behind the API key like every route.

The engine does the work and keeps the rules (docs/serving.md): it reads and checks the folder
against the base model, and refuses to unload an adapter that requests are using. Its answers
become HTTP errors here: 404 for an adapter it does not hold, 409 for a name taken or an
adapter in use, 400 naming the field for a folder that is missing or does not fit the base.
"""

from __future__ import annotations

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from astrai.infer import AdapterError, AdapterInUse, UnknownAdapter
from astrai.serve.adapters import adapter_name_problem, loaded_adapters
from astrai.serve.bodies import decode_body, json_response
from astrai.serve.errors import APIError, bad_request
from astrai.serve.models import model_entry
from astrai.serve.schemas_openai import AdapterDeleted, AdapterLoad
from astrai.serve.state import AppState, check_generates

_load_decoder = msgspec.json.Decoder(AdapterLoad)


def check_new_name(state: AppState, name: str) -> None:
    problem = adapter_name_problem(name, state.model_name)
    if problem is not None:
        raise bad_request(problem + ".", "name")
    if name in loaded_adapters(state.engine):
        raise APIError(
            409, f"An adapter named `{name}` is loaded already: unload it first.", "name"
        )


async def load_adapter(state: AppState, body: bytes) -> Response:
    """-> 200 with the adapter's entry of /v1/models once it serves."""
    check_generates(state)
    req = decode_body(_load_decoder, body)
    check_new_name(state, req.name)
    try:
        # reading the folder takes a while: off the event loop, which keeps serving
        await anyio.to_thread.run_sync(state.engine.load_adapter, req.name, req.path)
    except (OSError, AdapterError) as exc:  # no folder, not an adapter, or not for this base
        raise bad_request(
            f"path: cannot load `{req.path}` as `{req.name}`: {exc}", "path"
        ) from None
    return json_response(model_entry(state, req.name))


async def unload_adapter(state: AppState, request: Request) -> Response:
    name = request.path_params["name"]
    check_generates(state)
    try:
        await anyio.to_thread.run_sync(state.engine.unload_adapter, name)
    except UnknownAdapter:
        loaded = ", ".join(f"`{n}`" for n in loaded_adapters(state.engine)) or "none"
        raise APIError(
            404, f"No adapter `{name}` is loaded (loaded: {loaded}).", "name", "model_not_found"
        ) from None
    except AdapterInUse as exc:
        raise APIError(
            409, f"The adapter `{name}` is in use: {exc}", code="adapter_in_use"
        ) from None
    return json_response(AdapterDeleted(name))
