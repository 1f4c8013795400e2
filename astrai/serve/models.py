"""GET /v1/models and /v1/models/{id}: the base model, then each LoRA adapter loaded over it
(`parent`: the base model, as vLLM lists adapters), in a shape both clients read."""

from __future__ import annotations

from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import Response

from astrai.serve.adapters import loaded_adapters
from astrai.serve.bodies import json_response
from astrai.serve.schemas_openai import Model, ModelList
from astrai.serve.state import AppState, check_model


def model_entry(state: AppState, adapter: str | None = None) -> Model:
    """The base model's entry, or an adapter's, whose `parent` is the base model."""
    created_at = datetime.fromtimestamp(state.created, UTC).isoformat()
    name = adapter or state.model_name
    parent = state.model_name if adapter else None
    return Model(name, state.created, created_at.replace("+00:00", "Z"), name, parent=parent)


async def list_models(state: AppState, request: Request) -> Response:
    """The base model first, then the adapters in the order they were loaded."""
    entries = [model_entry(state)]
    entries += [model_entry(state, name) for name in loaded_adapters(state.engine)]
    return json_response(ModelList(entries, entries[0].id, entries[-1].id))


async def get_model(state: AppState, request: Request) -> Response:
    adapter = check_model(state, request.path_params["model_id"])
    return json_response(model_entry(state, adapter))
