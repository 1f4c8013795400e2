"""LoRA adapters over the served base model: which one a request's `model` names, and their
names' rules.

A request names the base model by its served name and an adapter by the adapter's name, or as
`<base>:<adapter>` (SGLang's form). Any other name is a 404, as it was before adapters: a
client that asks for a model this server does not hold learns so instead of getting another.
The engine holds the adapters (`Engine.adapters()`); the server keeps no list of its own, so
what it routes to is what the engine runs.
"""

from __future__ import annotations

import re

from astrai.serve.errors import APIError

# Names travel in URLs (DELETE /v1/adapters/{name}) and in `model`, where ":" splits base and
# adapter: letters, digits and . _ - only.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def adapter_name_problem(name: str, base_name: str) -> str | None:
    """Why `name` cannot name an adapter of base model `base_name`, or None when it can."""
    if not ADAPTER_NAME.fullmatch(name):
        return (
            f"`{name}` is not an adapter name: use 1 to 128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if name == base_name:
        return f"`{name}` is the base model's name; give the adapter another"
    return None


def loaded_adapters(engine) -> list[str]:
    """The names of the adapters the engine holds, in the order they were loaded (none for an
    encoder model)."""
    listing = getattr(engine, "adapters", None)
    return [info.name for info in listing()] if listing is not None else []


def not_found(model: str, base_name: str, adapters: list[str]) -> APIError:
    served = ", ".join(f"`{n}`" for n in [base_name, *adapters])
    return APIError(
        404,
        f"The model `{model}` does not exist; this server serves {served}.",
        "model",
        "model_not_found",
    )


def requested_adapter(engine, base_name: str, model: str) -> str | None:
    """None when `model` names the base model, the adapter's name when it names an adapter
    (`name` or `<base>:name`); an APIError 404 naming what is served otherwise."""
    if model == base_name:
        return None
    adapters = loaded_adapters(engine)
    name = model.removeprefix(f"{base_name}:")
    if name in adapters:
        return name
    raise not_found(model, base_name, adapters)
