"""Many LoRA adapters over one base model, held side by side for batches that mix them.

The stack is a plain dict (a pytree):

    {"A": {weight key: [slots * rank, in]},   slot s owns rows s * rank .. (s + 1) * rank
     "B": {weight key: [out, slots * rank]},  ... and the same columns
     "scale": [slots],                         each slot's alpha / rank (0 while free)
     "rank": rank,
     "names": {adapter name: slot},
     "where": {weight key: (stack key, part, first output row)}}

Each adapter's A and B sit in one matrix per weight, so the update of a whole batch is two
matrix products (astrai.model.lora_product), whatever adapters its rows use. With `fused=True`
the stack matches prepared weights (astrai.infer.prepare fuses q/k/v into `qkv_proj` and
gate/up into `gate_up_proj`): the parts' A stacked part after part, `[parts * slots * rank,
in]`, and their B block-diagonal, `[sum of outs, parts * slots * rank]`, so a fused product
takes its update in two products too (the products alone measured faster so in bfloat16, but
whole decode steps no faster than with one update per part: docs/serving.md). `where` says
where each weight's adapters live.

An adapter of a
lower rank than the stack's is padded with zeros (its product is unchanged); a weight it does
not adapt stays zero in its slot.

`stack_adapter` and `unstack_adapter` write the slot's rows in place: the stack is donated, as
the KV pool is; use the one they return.
"""

from __future__ import annotations

import torch

from astrai.config import LORA_TARGETS, ModelConfig
from astrai.model.layers import FUSED
from astrai.model.lora_folder import (
    AdapterError,
    AdapterMismatch,
    UnknownAdapter,
    adaptable_shapes,
)

Stack = dict


def init_adapter_stack(
    cfg: ModelConfig,
    slots: int,
    rank: int,
    targets: tuple[str, ...] = LORA_TARGETS,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    fused: bool = False,
) -> Stack:
    """An empty stack of `slots` adapters of rank up to `rank` over the weights whose module
    names are in `targets`, in `dtype`: the activations' dtype (with 8-bit base weights too,
    the low-rank products run in the activations' dtype). fused: laid out for prepared
    weights, whose sibling projections are one matrix (a part outside `targets` then stays
    zero beside its siblings)."""
    if slots < 1 or rank < 1:
        raise ValueError(f"an adapter stack needs slots >= 1 and rank >= 1, got {slots}, {rank}")
    shapes = adaptable_shapes(cfg)
    where = {key: (key, 0, 0) for key in shapes if key.rsplit(".", 2)[-2] in targets}
    if not where:
        raise ValueError(f"no weight of the model matches the targets {targets}")
    groups = {key: [key] for key in where}
    if fused:
        groups = _fused_groups(set(where), shapes)
        where = {}
        for name, parts in groups.items():
            offsets = [0, *(sum(shapes[p][0] for p in parts[:j]) for j in range(1, len(parts)))]
            where |= {p: (name, j, offsets[j]) for j, p in enumerate(parts)}
    width = slots * rank
    zeros = dict(dtype=dtype, device=device)
    A, B = {}, {}
    for name, parts in groups.items():
        A[name] = torch.zeros(len(parts) * width, shapes[parts[0]][1], **zeros)
        B[name] = torch.zeros(sum(shapes[p][0] for p in parts), len(parts) * width, **zeros)
    scale = torch.zeros(slots, **zeros)
    return {"A": A, "B": B, "scale": scale, "rank": rank, "names": {}, "where": where}


def _fused_groups(keys: set[str], shapes: dict) -> dict[str, list[str]]:
    """{stack key: its parts' weight keys}: each FUSED group with a part among keys becomes one
    key named as prepare_params names the fused matrix; the other keys stay alone."""
    groups: dict[str, list[str]] = {}
    for key in sorted(keys):
        prefix, module, _ = key.rsplit(".", 2)
        for fused, parts in FUSED.items():
            siblings = [f"{prefix}.{part}.weight" for part in parts]
            if module in parts and all(s in shapes for s in siblings):
                groups[f"{prefix}.{fused}.weight"] = siblings
                break
        else:
            groups[key] = [key]
    return groups


def stack_rank(stack: Stack) -> int:
    return stack["rank"]


def free_slots(stack: Stack) -> list[int]:
    taken = set(stack["names"].values())
    return [s for s in range(stack["scale"].shape[0]) if s not in taken]


def stack_adapter(stack: Stack, name: str, lora: dict) -> Stack:
    """The stack with the LoRA tree `lora` ({"scale", "weights"}, as load_lora gives) in its
    lowest free slot under `name`. AdapterError names what does not fit: a name already held,
    no free slot, a rank above the stack's, a weight the stack does not hold. Donated."""
    if name in stack["names"]:
        raise AdapterError(f"adapter {name!r} is already loaded")
    free = free_slots(stack)
    if not free:
        raise AdapterError(f"no free adapter slot for {name!r} ({len(stack['names'])} loaded)")
    rank = stack_rank(stack)
    for key, pair in lora["weights"].items():
        if key not in stack["where"]:
            raise AdapterMismatch(f"adapter {name!r} adapts {key}, which the stack does not hold")
        if pair["A"].shape[0] > rank:
            raise AdapterMismatch(f"adapter {name!r} has rank {pair['A'].shape[0]} > {rank}")
        a, b = _slot_blocks(stack, key, 0)
        want = (b.shape[0], a.shape[1])
        if (pair["B"].shape[0], pair["A"].shape[1]) != want:
            got = (pair["B"].shape[0], pair["A"].shape[1])
            raise AdapterMismatch(
                f"adapter {name!r}: {key} has (out, in) = {got}, its weight needs {want}"
            )
    slot = free[0]
    _clear(stack, slot)
    for key, pair in lora["weights"].items():
        a, b = _slot_blocks(stack, key, slot)
        r = pair["A"].shape[0]
        a[:r] = pair["A"]
        b[:, :r] = pair["B"]
    stack["scale"][slot] = lora["scale"]
    return {**stack, "names": {**stack["names"], name: slot}}


def _slot_blocks(stack: Stack, key: str, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of weight `key`'s A [rank, in] and B [out, rank] in `slot`."""
    name, part, first = stack["where"][key]
    rank, width = stack_rank(stack), stack["scale"].shape[0] * stack_rank(stack)
    cols = slice(part * width + slot * rank, part * width + (slot + 1) * rank)
    a, b = stack["A"][name][cols], stack["B"][name][:, cols]
    out = b.shape[0] if name == key else _out_rows(stack, key)
    return a, b[first : first + out]


def _out_rows(stack: Stack, key: str) -> int:
    """The output rows of part `key` of a fused matrix: up to the next part's first row."""
    name, part, first = stack["where"][key]
    following = [f for n, p, f in stack["where"].values() if n == name and p == part + 1]
    return (following[0] if following else stack["B"][name].shape[0]) - first


def _clear(stack: Stack, slot: int) -> None:
    for key in stack["where"]:
        a, b = _slot_blocks(stack, key, slot)
        a.zero_(), b.zero_()


def unstack_adapter(stack: Stack, name: str) -> Stack:
    """The stack without adapter `name`; its slot is zeroed and free again. Donated."""
    if name not in stack["names"]:
        raise UnknownAdapter(f"adapter {name!r} is not loaded")
    names = dict(stack["names"])
    slot = names.pop(name)
    _clear(stack, slot)
    stack["scale"][slot] = 0
    return {**stack, "names": names}


def adapter_slots(stack: Stack, names: list[str | None]) -> torch.Tensor:
    """The slot of each row's adapter (-1 for None: the base model alone), as a long tensor
    [rows]; AdapterError names an adapter that is not loaded."""
    for name in names:
        if name is not None and name not in stack["names"]:
            raise UnknownAdapter(f"adapter {name!r} is not loaded")
    slots = [-1 if name is None else stack["names"][name] for name in names]
    return torch.tensor(slots, dtype=torch.long, device=stack["scale"].device)
