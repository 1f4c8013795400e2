"""The low-rank updates of a batch whose rows use different adapters (or none).

The base product runs once for every row; each row then adds scale_i * (x @ A_i.T) @ B_i.T of
its own adapter i. Punica's BGMV and S-LoRA's segmented GEMM gather each row's A and B; on a
CPU the gathered copies cost more than they save, so here all the stack's adapters multiply
every row at once, x @ [A_0; A_1; ...].T, a mask zeroes the columns of the adapters a row does
not use (and applies its scale), and one more product by [B_0, B_1, ...] sums the rest:
two matrix products per weight, no gather and no host round trip. It costs in proportion to
the adapters held, not to those in use; docs/serving.md has the measurements.

On prompt chunks, where each row of the batch is a sequence of many tokens of one adapter,
grouping the rows by adapter (S-LoRA's segmented GEMM) multiplies each token by its own adapter
alone and wins instead (256 token rows over 8 adapters: about 0.8-1.1x the base products'
time on top of them, against about 1.5x for the masked way; docs/serving.md):
`grouped_lora(stack, slots)` binds a stack that way.

`mixed_lora(stack, slots)` or `grouped_lora(stack, slots)` binds a stack to one batch;
`forward`, `prefill` and `decode_step` take the result as their `lora` argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mixed_lora(stack: dict, slots: torch.Tensor) -> dict:
    """The `lora` argument for a batch whose row b uses the adapter in slot `slots[b]` (-1: no
    adapter; see adapter_slots): {"stack": stack, "mask": [B, 1, slots * rank]}, the mask
    holding each row's scale over its own adapter's columns and zeros elsewhere."""
    count, rank = stack["scale"].shape[0], stack["rank"]
    _check_slots(stack, slots)
    scale = stack["scale"]
    used = slots >= 0
    own = F.one_hot(slots.clamp(min=0), count).to(scale.dtype) * scale
    own = own * used[:, None].to(scale.dtype)
    return {"stack": stack, "mask": own.repeat_interleave(rank, dim=1)[:, None, :]}


def grouped_lora(stack: dict, slots: torch.Tensor) -> dict:
    """The `lora` argument for a batch of sequences (rows of x [B, T, in]) whose row b uses the
    adapter in slot `slots[b]` (-1: none), applied group by group: {"stack", "rows": B,
    "groups": [(slot, its rows [n], its scale)]}. Only for a stack made with fused=False."""
    if any(name != key for key, (name, _, _) in stack["where"].items()):
        raise ValueError("grouped_lora takes a stack made with fused=False")
    _check_slots(stack, slots)
    groups = [
        (slot, (slots == slot).nonzero()[:, 0], stack["scale"][slot])
        for slot in sorted(set(slots.tolist()) - {-1})
    ]
    return {"stack": stack, "rows": slots.shape[0], "groups": groups}


def _check_slots(stack: dict, slots: torch.Tensor) -> None:
    count = stack["scale"].shape[0]
    if slots.dim() != 1:
        raise ValueError(f"slots must be one index per row, got shape {tuple(slots.shape)}")
    if bool((slots >= count).any()) or bool((slots < -1).any()):
        raise ValueError(f"slots must lie in -1 .. {count - 1}, got {slots.tolist()}")


def grouped_delta(x: torch.Tensor, lora: dict, key: str) -> torch.Tensor | None:
    """mixed_delta for a binding of grouped_lora: each group's rows through its own adapter's
    A and B alone; rows without an adapter get zeros."""
    stack = lora["stack"]
    a = stack["A"].get(key)
    if a is None:
        return None
    b, rank = stack["B"][key], stack["rank"]
    xs = x.view(lora["rows"], -1, x.shape[-1])
    xs = xs if xs.dtype == a.dtype else xs.to(a.dtype)
    out = xs.new_zeros(*xs.shape[:2], b.shape[0])
    for slot, rows, scale in lora["groups"]:
        cols = slice(slot * rank, (slot + 1) * rank)
        h = F.linear(xs.index_select(0, rows), a[cols])
        out.index_copy_(0, rows, F.linear(h * scale, b[:, cols]))
    out = out.view(*x.shape[:-1], b.shape[0])
    return out if out.dtype == x.dtype else out.to(x.dtype)


def mixed_delta(x: torch.Tensor, lora: dict, key: str) -> torch.Tensor | None:
    """Each row's update of weight `key` for x [B, T, in] (or [B * T, in], rows batch-major)
    in x's dtype, or None when the stack does not adapt `key`. A fused stack's matrix holds
    several parts' columns, one block of slots * rank per part, each masked alike."""
    if "groups" in lora:
        return grouped_delta(x, lora, key)
    stack = lora["stack"]
    a = stack["A"].get(key)
    if a is None:
        if key in stack["where"]:
            raise ValueError(
                f"the adapter stack holds {key} fused with its siblings: use it with prepared "
                "(fused) weights, or make the stack with fused=False"
            )
        return None
    b, mask = stack["B"][key], lora["mask"]
    h = F.linear(x if x.dtype == a.dtype else x.to(a.dtype), a)
    parts = h.shape[-1] // mask.shape[-1]
    h = (h.view(mask.shape[0], -1, parts, mask.shape[-1]) * mask[:, :, None]).view(h.shape)
    y = F.linear(h, b)
    return y if y.dtype == x.dtype else y.to(x.dtype)
