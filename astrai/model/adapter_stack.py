"""Many LoRA adapters over one base model, held side by side for batches that mix them.

The stack is a plain dict (a pytree):

    {"A": {weight key: [slots * rank, in]},   slot s owns rows s * rank .. (s + 1) * rank
     "B": {weight key: [out, slots * rank]},  ... and the same columns
     "scale": [slots],                         each slot's alpha / rank (0 while free)
     "names": {adapter name: slot}}

Each adapter's A and B sit in one matrix per weight, so the update of a whole batch is two
matrix products (astrai.model.lora_product), whatever adapters its rows use. An adapter of a
lower rank than the stack's is padded with zeros (its product is unchanged); a weight it does
not adapt stays zero in its slot.

`stack_adapter` and `unstack_adapter` write the slot's rows in place: the stack is donated, as
the KV pool is; use the one they return.
"""

from __future__ import annotations

import torch

from astrai.config import LORA_TARGETS, ModelConfig
from astrai.model.lora_folder import AdapterError, adaptable_shapes

Stack = dict


def init_adapter_stack(
    cfg: ModelConfig,
    slots: int,
    rank: int,
    targets: tuple[str, ...] = LORA_TARGETS,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> Stack:
    """An empty stack of `slots` adapters of rank up to `rank` over the weights whose module
    names are in `targets`, in `dtype`: the activations' dtype (with 8-bit base weights too,
    the low-rank products run in the activations' dtype)."""
    if slots < 1 or rank < 1:
        raise ValueError(f"an adapter stack needs slots >= 1 and rank >= 1, got {slots}, {rank}")
    shapes = {
        key: shape
        for key, shape in adaptable_shapes(cfg).items()
        if key.rsplit(".", 2)[-2] in targets
    }
    if not shapes:
        raise ValueError(f"no weight of the model matches the targets {targets}")
    width = slots * rank
    zeros = dict(dtype=dtype, device=device)
    return {
        "A": {key: torch.zeros(width, shape[1], **zeros) for key, shape in shapes.items()},
        "B": {key: torch.zeros(shape[0], width, **zeros) for key, shape in shapes.items()},
        "scale": torch.zeros(slots, **zeros),
        "names": {},
    }


def stack_rank(stack: Stack) -> int:
    return next(iter(stack["A"].values())).shape[0] // stack["scale"].shape[0]


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
        if key not in stack["A"]:
            raise AdapterError(f"adapter {name!r} adapts {key}, which the stack does not hold")
        if pair["A"].shape[0] > rank:
            raise AdapterError(f"adapter {name!r} has rank {pair['A'].shape[0]} > {rank}")
        want = (stack["B"][key].shape[0], stack["A"][key].shape[1])
        if (pair["B"].shape[0], pair["A"].shape[1]) != want:
            raise AdapterError(f"adapter {name!r}: {key} does not fit its weight {want}")
    slot = free[0]
    rows = slice(slot * rank, (slot + 1) * rank)
    for key in stack["A"]:
        a, b = stack["A"][key][rows], stack["B"][key][:, rows]
        a.zero_(), b.zero_()
        if (pair := lora["weights"].get(key)) is not None:
            r = pair["A"].shape[0]
            a[:r] = pair["A"]
            b[:, :r] = pair["B"]
    stack["scale"][slot] = lora["scale"]
    return {**stack, "names": {**stack["names"], name: slot}}


def unstack_adapter(stack: Stack, name: str) -> Stack:
    """The stack without adapter `name`; its slot is zeroed and free again. Donated."""
    if name not in stack["names"]:
        raise AdapterError(f"adapter {name!r} is not loaded")
    names = dict(stack["names"])
    slot = names.pop(name)
    rank = stack_rank(stack)
    rows = slice(slot * rank, (slot + 1) * rank)
    for key in stack["A"]:
        stack["A"][key][rows] = 0
        stack["B"][key][:, rows] = 0
    stack["scale"][slot] = 0
    return {**stack, "names": names}


def adapter_slots(stack: Stack, names: list[str | None]) -> torch.Tensor:
    """The slot of each row's adapter (-1 for None: the base model alone), as a long tensor
    [rows]; AdapterError names an adapter that is not loaded."""
    for name in names:
        if name is not None and name not in stack["names"]:
            raise AdapterError(f"adapter {name!r} is not loaded")
    slots = [-1 if name is None else stack["names"][name] for name in names]
    return torch.tensor(slots, dtype=torch.long, device=stack["scale"].device)
