"""The low-rank updates of a batch whose rows use different adapters (or none).

The base product runs once for every row; each row then adds scale_i * (x @ A_i.T) @ B_i.T of
its own adapter i. Punica's BGMV and S-LoRA's segmented GEMM gather each row's A and B; on a
CPU the gathered copies cost more than they save, so here all the stack's adapters multiply
every row at once, x @ [A_0; A_1; ...].T, a mask zeroes the columns of the adapters a row does
not use (and applies its scale), and one more product by [B_0, B_1, ...] sums the rest:
two matrix products per weight, no gather and no host round trip. It costs in proportion to
the adapters held, not to those in use; docs/serving.md has the measurements.

`mixed_lora(stack, slots)` binds a stack to one batch; `forward`, `prefill` and `decode_step`
take the result as their `lora` argument.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mixed_lora(stack: dict, slots: torch.Tensor) -> dict:
    """The `lora` argument for a batch whose row b uses the adapter in slot `slots[b]` (-1: no
    adapter; see adapter_slots): {"stack": stack, "mask": [B, 1, slots * rank]}, the mask
    holding each row's scale over its own adapter's columns and zeros elsewhere."""
    count, rank = stack["scale"].shape[0], stack["rank"]
    if slots.dim() != 1:
        raise ValueError(f"slots must be one index per row, got shape {tuple(slots.shape)}")
    if bool((slots >= count).any()) or bool((slots < -1).any()):
        raise ValueError(f"slots must lie in -1 .. {count - 1}, got {slots.tolist()}")
    scale = stack["scale"]
    used = slots >= 0
    own = F.one_hot(slots.clamp(min=0), count).to(scale.dtype) * scale
    own = own * used[:, None].to(scale.dtype)
    return {"stack": stack, "mask": own.repeat_interleave(rank, dim=1)[:, None, :]}


def mixed_delta(x: torch.Tensor, lora: dict, key: str) -> torch.Tensor | None:
    """Each row's update of weight `key` for x [B, T, in] (or [B * T, in], rows batch-major)
    in x's dtype, or None when the stack does not adapt `key`. A fused stack's matrix holds
    several parts' columns, one block of slots * rank per part, each masked alike."""
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
