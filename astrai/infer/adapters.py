"""LoRA adapters in the engine: many over one base model, chosen per request, mixed in a batch.

The engine state holds one adapter stack (astrai.model.adapter_stack): every loaded adapter's
A and B side by side, one slot each, made at the first load with `max_adapters` slots of rank
`max_adapter_rank` over the modules `adapter_targets` (EngineConfig; the rank and modules of
the first adapter when not set). A step binds the stack to each batch's rows (`batch_lora`):
a decode batch multiplies every row by all the adapters and masks what a row does not use (two
products a weight: fastest at a few rows an adapter), a batch of prompt chunks groups its rows
by adapter (many token rows an adapter); a batch of base-model rows alone runs no adapter work.

Errors, all raised to the caller: `UnknownAdapter` (a request or an unload names an adapter
that is not loaded), `AdapterMismatch` (an adapter's modules, rank or shapes do not fit the
base model or the stack; the message names the module and the shapes) and `AdapterInUse`
(unloading an adapter that running or waiting requests use). Unloading refuses rather than
drains: a drain would keep refusing nothing while new requests keep arriving for the adapter,
and a caller that wants a drain can stop sending them and retry; refusing leaves every
running request's output as it would have been.

Each load gets a key of its own for the prefix cache, so K/V computed with one adapter are
never served to another, to the base model, or to an adapter loaded again under the same name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from astrai.config import LORA_TARGETS, LoraConfig
from astrai.infer.donation import donates
from astrai.infer.scheduler import drop_cached_key
from astrai.infer.sequence import Sequence
from astrai.model import DTYPES
from astrai.model.adapter_stack import (
    adapter_slots,
    free_slots,
    init_adapter_stack,
    stack_adapter,
    unstack_adapter,
)
from astrai.model.lora_folder import (
    AdapterError,
    AdapterMismatch,
    UnknownAdapter,
    adaptable_shapes,
)
from astrai.model.lora_product import grouped_lora, mixed_lora

__all__ = [
    "AdapterError",
    "AdapterInUse",
    "AdapterInfo",
    "AdapterMismatch",
    "Adapters",
    "UnknownAdapter",
    "adapter_bytes",
    "batch_lora",
    "check_adapter",
]


class AdapterInUse(RuntimeError):
    """Unloading an adapter that running or waiting requests use: refused, `count` of them."""

    def __init__(self, name: str, count: int):
        super().__init__(
            f"adapter {name!r} is used by {count} running or waiting request(s); "
            "unload it once they finish (or cancel them)"
        )
        self.name, self.count = name, count


class AdapterInfo(msgspec.Struct, frozen=True):
    """A loaded adapter as callers see it."""

    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]


@dataclass(eq=False)
class Adapters:
    """The engine's adapters: the stack (None while none is loaded), what each loaded one is,
    and the prefix cache's key of each (a count of loads: never reused)."""

    stack: dict | None = None
    info: dict[str, AdapterInfo] = field(default_factory=dict)
    keys: dict[str, int] = field(default_factory=dict)
    loads: int = 0


def _module(key: str) -> str:
    return key.rsplit(".", 2)[-2]


def check_adapter(shapes: dict, lora: dict, lora_cfg: LoraConfig, name: str) -> None:
    """AdapterMismatch naming what of `lora` ({"scale", "weights": {key: {"A", "B"}}}) does
    not fit a base model whose adaptable weights have `shapes` ({key: (out, in)})."""
    if not lora.get("weights"):
        raise AdapterMismatch(f"adapter {name!r} adapts no weight")
    for key, pair in lora["weights"].items():
        if key not in shapes:
            raise AdapterMismatch(
                f"adapter {name!r}: module {key.removesuffix('.weight')} is not one the base "
                "model's forward adapts"
            )
        out, inp = shapes[key]
        a, b = tuple(pair["A"].shape), tuple(pair["B"].shape)
        rank = a[0] if a else 0
        if a != (rank, inp) or b != (out, rank) or rank != lora_cfg.rank:
            raise AdapterMismatch(
                f"adapter {name!r}: {key.removesuffix('.weight')} has A {a} and B {b}; the base "
                f"model with rank {lora_cfg.rank} needs A {(lora_cfg.rank, inp)} and "
                f"B {(out, lora_cfg.rank)}"
            )


def _new_stack(state, lora: dict, lora_cfg: LoraConfig) -> dict:
    config = state.engine_config
    rank = config.max_adapter_rank or lora_cfg.rank
    targets = config.adapter_targets or tuple(sorted({_module(k) for k in lora["weights"]}))
    order = {t: i for i, t in enumerate(LORA_TARGETS)}
    targets = tuple(sorted(targets, key=lambda t: (order.get(t, len(order)), t)))
    return init_adapter_stack(
        state.model_config,
        config.max_adapters,
        rank,
        targets,
        DTYPES[config.dtype],
        torch.device(config.device),
    )


def _check_stack(stack: dict, lora: dict, lora_cfg: LoraConfig, name: str) -> None:
    """AdapterMismatch when the adapter's rank or modules exceed what the stack holds."""
    if lora_cfg.rank > stack["rank"]:
        raise AdapterMismatch(
            f"adapter {name!r} has rank {lora_cfg.rank}, above the engine's adapter rank "
            f"{stack['rank']} (set max_adapter_rank)"
        )
    held = {_module(k) for k in stack["where"]}
    for key in lora["weights"]:
        if key not in stack["where"]:
            raise AdapterMismatch(
                f"adapter {name!r} adapts {key.removesuffix('.weight')}; the engine's adapters "
                f"adapt {sorted(held)} (set adapter_targets)"
            )


@donates
def load_adapter(state, name: str, lora_params: dict, lora_cfg: LoraConfig):
    """The state with LoRA adapter `name` loaded: `lora_params` {"scale", "weights"} (as
    init_lora / load_lora give), `lora_cfg` its LoraConfig. AdapterMismatch names what does
    not fit; AdapterError: the name is taken or every slot (max_adapters) is. Donated."""
    if not isinstance(name, str) or not name:
        raise AdapterError(f"an adapter's name must be a non-empty string, got {name!r}")
    ad = state.adapters
    if name in ad.info:
        raise AdapterError(f"adapter {name!r} is already loaded; unload it first")
    check_adapter(adaptable_shapes(state.model_config), lora_params, lora_cfg, name)
    stack = ad.stack if ad.stack is not None else _new_stack(state, lora_params, lora_cfg)
    _check_stack(stack, lora_params, lora_cfg, name)
    if not free_slots(stack):
        raise AdapterError(
            f"no free adapter slot for {name!r}: {len(ad.info)} loaded (max_adapters)"
        )
    ad.stack = stack_adapter(stack, name, lora_params)
    ad.loads += 1
    ad.keys[name] = ad.loads
    targets = tuple(sorted({_module(k) for k in lora_params["weights"]}))
    ad.info[name] = AdapterInfo(name, lora_cfg.rank, float(lora_cfg.alpha), targets)
    return state


def adapter_users(state, name: str) -> list[Sequence]:
    return [seq for seq in (*state.sched.running, *state.sched.waiting) if seq.adapter == name]


@donates
def unload_adapter(state, name: str):
    """The state without adapter `name`; its slot is free and the prefix cache's pages of it
    are dropped. UnknownAdapter when it is not loaded; AdapterInUse (naming the count) while
    running or waiting requests use it: refused, not drained (see the module docstring).
    Donated."""
    ad = state.adapters
    if name not in ad.info:
        raise UnknownAdapter(f"adapter {name!r} is not loaded (loaded: {sorted(ad.info)})")
    users = adapter_users(state, name)
    if users:
        raise AdapterInUse(name, len(users))
    state.sched = drop_cached_key(state.sched, ad.keys.pop(name))
    del ad.info[name]
    # with none left the stack goes: its memory, and the rank and modules the next load sets
    ad.stack = unstack_adapter(ad.stack, name) if ad.info else None
    return state


def adapter_list(state) -> list[AdapterInfo]:
    """The loaded adapters, in the order they were loaded."""
    return list(state.adapters.info.values())


def adapter_bytes(state) -> int:
    """Bytes the adapter stack holds (every slot, loaded or free; 0 while none is loaded)."""
    stack = state.adapters.stack
    if stack is None:
        return 0
    tensors = [*stack["A"].values(), *stack["B"].values(), stack["scale"]]
    return sum(t.numel() * t.element_size() for t in tensors)


def resolve_adapter(state, seq: Sequence) -> Sequence:
    """seq with its prefix cache key set; UnknownAdapter when its adapter is not loaded."""
    if seq.adapter is None:
        seq.prefix_key = None
        return seq
    key = state.adapters.keys.get(seq.adapter)
    if key is None:
        raise UnknownAdapter(
            f"adapter {seq.adapter!r} is not loaded (loaded: {sorted(state.adapters.info)})"
        )
    seq.prefix_key = key
    return seq


# Token rows per adapter in a batch from which grouping the rows by adapter beats multiplying
# every row by all adapters and masking (programs/benchmark/lora_products.py, 8 adapters of
# rank 16: at 2 rows an adapter, a decode step, the masked way wins; at ~28, prompt chunks,
# grouping does; docs/inference.md has the figures).
GROUPED_FROM = 16


def batch_lora(adapters: Adapters, seqs: list[Sequence], tokens: int = 1) -> dict | None:
    """The `lora` argument of a batch of seqs, `tokens` a row (row i runs seqs[i].adapter):
    None when every row runs the base model alone; rows grouped by adapter when the batch
    holds GROUPED_FROM token rows an adapter or more, else all adapters masked per row."""
    names = [seq.adapter for seq in seqs]
    used = {n for n in names if n is not None}
    if adapters.stack is None or not used:
        return None
    slots = adapter_slots(adapters.stack, names)
    if tokens * len(seqs) >= GROUPED_FROM * len(used):
        return grouped_lora(adapters.stack, slots)
    return mixed_lora(adapters.stack, slots)
