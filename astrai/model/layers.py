"""The small building blocks, as plain functions of tensors."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from astrai.kernels import pointwise
from astrai.kernels.paged_attention import PagedMask, paged_attention
from astrai.model import products
from astrai.model.lora_product import mixed_delta
from astrai.model.masked_attention import (
    attend_by_products,
    attend_causal,
    attend_masked,
    causal_mask,
)
from astrai.model.params import Params


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype. `Tensor.to` costs ~0.8 us even when there is nothing to convert, and a decode
    step of a small model calls for ~80 such conversions, most of them no-ops."""
    return x if x.dtype == dtype else x.to(dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> torch.Tensor:
    if not unit_offset and (y := pointwise.rms_norm(x, weight, eps)) is not None:
        return y  # inference on the CPU: one C call
    if unit_offset:  # Gemma: scale by 1 + weight in float32, rounding once at the end
        return cast(F.rms_norm(x.float(), weight.shape, weight.float() + 1.0, eps), x.dtype)
    if x.dtype == weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one call: its six ops run in C++
    # Normalise in float32 so bfloat16 activations keep their precision, and round before the
    # weight multiplies, as Llama does.
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def norm(params: Params, cfg, key: str, x: torch.Tensor) -> torch.Tensor:
    """The model's RMSNorm (cfg: a ModelConfig) with the weight `key`."""
    return rms_norm(x, params[key], cfg.rms_norm_eps, cfg.rms_norm_unit_offset)


def add_norm(
    params: Params, cfg, key: str, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, the model's RMSNorm of it with the weight `key`): a residual add and the norm
    that follows it, one pass of the C kernel where it takes them (inference on the CPU)."""
    if not cfg.rms_norm_unit_offset:
        both = pointwise.rms_norm(x, params[key], cfg.rms_norm_eps, residual=y)
        if both is not None:
            return both
    x = x + y
    return x, norm(params, cfg, key, x)


def project(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias). W is a tensor (in a float32 training step on the CPU multiplied by the
    faster library here: model/products.py), or a prepared inference weight (an 8-bit or a
    oneDNN-packed matrix, see astrai.infer.prepare) that brings its own product as `.linear(x)`."""
    if not isinstance(weight, torch.Tensor):
        y = weight.linear(x)
    elif products.takes(x, weight):
        y = products.linear(x, weight)  # training's float32 products, by the faster library
    else:
        return F.linear(x, weight, bias)
    return y if bias is None else y + bias


def linear(params: Params, name: str, x: torch.Tensor, lora: dict | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for the weight `{name}.weight`, plus its LoRA update when there is one."""
    y = project(x, params[f"{name}.weight"], params.get(f"{name}.bias"))
    delta = None if lora is None else lora_delta(x, lora, f"{name}.weight")
    return y if delta is None else y + delta


def lora_delta(x: torch.Tensor, lora: dict, key: str) -> torch.Tensor | None:
    """The LoRA update of weight `key` for x, or None where it has none. lora: one adapter
    for every row ({"scale", "weights"}), or a stack bound to the batch's rows by
    astrai.model.lora_product.mixed_lora (each row its own adapter)."""
    if "stack" in lora:
        return mixed_delta(x, lora, key)
    if (pair := lora["weights"].get(key)) is None:
        return None
    return lora["scale"] * F.linear(F.linear(x, pair["A"]), pair["B"])


# Projections that read the same input, which inference weights hold as one matrix
# (astrai.infer.prepare_params): a decode step is a chain of matrix-vector products, and fewer,
# larger ones stream the weights faster (a bf16 step of the small benchmark model ~1.25x faster
# on AMD Zen 4).
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def fused_linear(
    params: Params, prefix: str, fused: str, x, lora, widths=None
) -> tuple[torch.Tensor, ...]:
    """The projections `{prefix}.{part}` of x for the parts of FUSED[fused], one product when
    the weights hold them fused as `{prefix}.{fused}`. widths: of the parts, the first one None
    (the rest of the fused output); equal parts when not given."""
    if f"{prefix}.{fused}.weight" not in params:
        return tuple(linear(params, f"{prefix}.{part}", x, lora) for part in FUSED[fused])
    y = linear(params, f"{prefix}.{fused}", x)
    # an adapter stack laid out for fused weights updates the fused product at once
    whole = None if lora is None else lora_delta(x, lora, f"{prefix}.{fused}.weight")
    y = y if whole is None else y + whole
    if widths is None:
        parts = y.chunk(len(FUSED[fused]), dim=-1)
    else:  # split_with_sizes: Tensor.split with a list is a Python wrapper, ~2.5x its cost
        parts = y.split_with_sizes([y.shape[-1] - sum(widths[1:]), *widths[1:]], dim=-1)
    if lora is None or whole is not None:
        return parts
    # Other adapters stay per part: each part's update is added to its slice of the product.
    deltas = [lora_delta(x, lora, f"{prefix}.{part}.weight") for part in FUSED[fused]]
    return tuple(p if d is None else p + d for p, d in zip(parts, deltas, strict=True))


# The activations of gated MLPs, by the names of ModelConfig.hidden_act.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


# A float32 prompt's MLP at inference runs in pieces of rows, each piece's fused gate-up output
# at most 16 MiB: under glibc's 32 MiB mmap threshold, a larger block is mapped and zeroed afresh
# each time it is made (astrai/infer/allocator.py), and a piece this size stays in a 32 MiB L3
# for the activation and the down projection. A 4 x 512 float32 prefill of the 0.5B shape (80
# MiB a layer whole) ran 1.11-1.12x as fast in 16 MiB pieces, 1.05x in 31 MiB ones, 1.03x in 4
# MiB (AMD Zen 5). bfloat16 prompts stay whole: the same pieces ran them 0.96-0.98x as fast.
PIECE_BYTES = 16 << 20


def gated_mlp(
    params: Params, prefix: str, x: torch.Tensor, lora: dict | None = None, act: str = "silu"
) -> torch.Tensor:
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with gelu."""
    if (pieces := _row_pieces(params, prefix, x, lora)) > 1:
        rows = x.reshape(-1, x.shape[-1]).tensor_split(pieces)
        out = torch.cat([_gated_mlp(params, prefix, r, None, act) for r in rows])
        return out.view(*x.shape[:-1], out.shape[-1])
    return _gated_mlp(params, prefix, x, lora, act)


def _gated_mlp(params: Params, prefix: str, x: torch.Tensor, lora, act: str) -> torch.Tensor:
    gate, up = fused_linear(params, prefix, "gate_up_proj", x, lora)
    return linear(params, f"{prefix}.down_proj", gated_activation(act, gate, up), lora)


def _row_pieces(params: Params, prefix: str, x: torch.Tensor, lora) -> int:
    """How many pieces of rows the MLP takes float32 x in (PIECE_BYTES): 1 for other dtypes,
    where a gradient is recorded or a graph traced (training), with adapters (bound to the
    batch's rows) and for weights not fused."""
    weight = params.get(f"{prefix}.gate_up_proj.weight")
    if weight is None or lora is not None or x.dtype != torch.float32:
        return 1
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return 1
    rows, row_bytes = x.numel() // x.shape[-1], weight.shape[0] * x.element_size()
    return -(-rows * row_bytes // PIECE_BYTES)


def gated_activation(act: str, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up: one C call where the kernel takes them (inference on the CPU)."""
    if (h := pointwise.gated_activation(act, gate, up)) is not None:
        return h
    return ACTIVATIONS[act](gate) * up


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention. q [B, H, T, D]; k, v [B, Hkv, S, D]; mask bool [B, 1, T, S]
    (True = may attend; or additive, 0 and -inf in q's dtype) or None for plain causal / full
    attention over T == S. softcap: scores s become softcap * tanh(s / softcap). With a
    PagedMask, k and v are a layer of the page pool read in place (decoding, T == 1)."""
    if isinstance(mask, PagedMask):
        return paged_attention(q, k, v, mask, scale)
    if softcap is not None:  # the fused kernels cannot cap the scores: they are made here
        if mask is None:
            T, S = q.shape[2], k.shape[2]
            mask = causal_mask(T, S, q.device) if causal else q.new_ones(T, S, dtype=torch.bool)
            mask = mask[None, None]
        return attend_by_products(q, k, v, mask, scale, softcap)
    if mask is not None:  # cached and paged inference, packed documents in training
        return attend_masked(q, k, v, mask, scale)
    if causal:  # training, and whole prompts without a cache
        return attend_causal(q, k, v, scale)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, scale=scale)
