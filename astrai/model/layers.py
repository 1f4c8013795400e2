"""The small building blocks, as plain functions of tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F

Params = dict[str, torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 so bfloat16 activations keep their precision, as Llama does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def linear(params: Params, name: str, x: torch.Tensor, lora: dict | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for the weight `{name}.weight`, plus its LoRA update when there is one."""
    y = F.linear(x, params[f"{name}.weight"], params.get(f"{name}.bias"))
    if lora is not None and (pair := lora["weights"].get(f"{name}.weight")) is not None:
        y = y + lora["scale"] * F.linear(F.linear(x, pair["A"]), pair["B"])
    return y


def swiglu(params: Params, prefix: str, x: torch.Tensor, lora: dict | None = None) -> torch.Tensor:
    gate = linear(params, f"{prefix}.gate_proj", x, lora)
    up = linear(params, f"{prefix}.up_proj", x, lora)
    return linear(params, f"{prefix}.down_proj", F.silu(gate) * up, lora)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention. q [B, H, T, D]; k, v [B, Hkv, S, D]; mask bool, True = see."""
    if k.shape[1] != q.shape[1]:
        # Grouped-query attention: each K/V head serves H / Hkv query heads.
        repeats = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(repeats, dim=1)
        v = v.repeat_interleave(repeats, dim=1)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale
    )
