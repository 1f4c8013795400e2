"""What every handler reads: the engine, its tokenizer, the limits, the metrics; and the token
budget arithmetic that turns a prompt length and a requested max_tokens into a checked number.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from msgspec import Struct

from astrai.serve.adapters import requested_adapter
from astrai.serve.errors import APIError, bad_request
from astrai.serve.metrics import Metrics


class AppState(Struct):
    engine: Any  # an astrai.infer.Engine, or an Encoder for embedding models
    tokenizer: Any
    model_name: str
    context: int  # tokens one sequence may hold: prompt + completion
    vocab_size: int
    serve_cfg: Any  # astrai.config.ServeConfig
    metrics: Metrics
    created: int  # when the server started, as the model's creation time


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def now() -> int:
    return int(time.time())


def check_model(state: AppState, model: str) -> str | None:
    """The adapter `model` names (None: the base model); a 404 for a model not served."""
    return requested_adapter(state.engine, state.model_name, model)


def prompt_too_long(n_prompt: int, context: int, param: str) -> APIError:
    return bad_request(
        f"The prompt is {n_prompt} tokens long; this model's context holds {context} tokens "
        f"including at least one generated token.",
        param,
        "context_length_exceeded",
    )


def token_budget(
    n_prompt: int, requested: int | None, context: int, default: int, param: str, prompt: str
) -> int:
    """max_tokens for a request: as asked when it fits the context; when not asked, the default
    cut to what is left of the context. A prompt that leaves no room is an error on `prompt`."""
    room = context - n_prompt
    if room < 1:
        raise prompt_too_long(n_prompt, context, prompt)
    if requested is None:
        return min(default, room)
    if requested > room:
        raise bad_request(
            f"{param} is {requested}, but the prompt is {n_prompt} tokens and this model's "
            f"context holds {context}: at most {room} tokens can be generated.",
            param,
            "context_length_exceeded",
        )
    return requested


def check_generates(state: AppState) -> None:
    """Generation routes need an Engine; an encoder model only embeds."""
    if not hasattr(state.engine, "astream"):
        raise bad_request(
            f"`{state.model_name}` is an encoder model: it answers /v1/embeddings only.", "model"
        )
