"""Parameter shapes and initialisation: the params pytree is a flat dict keyed like safetensors."""

from __future__ import annotations

import math
from typing import Protocol

import torch

from astrai.config import ModelConfig


class Matrix(Protocol):
    """A prepared inference weight W [out, in] (astrai.infer's Int8Matrix, PackedMatrix) that
    brings its own product: `linear(x)` is x @ W.T."""

    @property
    def shape(self) -> torch.Size: ...

    def linear(self, x: torch.Tensor) -> torch.Tensor: ...


# The weights pytree, keyed like safetensors: tensors, or prepared matrices for inference.
Params = dict[str, torch.Tensor | Matrix]

# the dtypes weights are kept in, by the names configs and files use
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _attention_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    if cfg.attn_type == "mla":
        H = cfg.num_attention_heads
        q_dim = H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        shapes = {
            f"{p}.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
            f"{p}.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
            f"{p}.kv_b_proj.weight": (
                H * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                cfg.kv_lora_rank,
            ),
            f"{p}.o_proj.weight": (h, H * cfg.v_head_dim),
        }
        if cfg.q_lora_rank:
            shapes[f"{p}.q_a_proj.weight"] = (cfg.q_lora_rank, h)
            shapes[f"{p}.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            shapes[f"{p}.q_b_proj.weight"] = (q_dim, cfg.q_lora_rank)
        else:
            shapes[f"{p}.q_proj.weight"] = (q_dim, h)
        return shapes
    D, H, Hkv = cfg.dim_per_head, cfg.num_attention_heads, cfg.kv_heads
    q_out = H * D * (2 if cfg.use_gated_attention else 1)
    shapes = {
        f"{p}.q_proj.weight": (q_out, h),
        f"{p}.k_proj.weight": (Hkv * D, h),
        f"{p}.v_proj.weight": (Hkv * D, h),
        f"{p}.o_proj.weight": (h, H * D),
    }
    if cfg.attention_bias:
        shapes |= {f"{p}.q_proj.bias": (q_out,), f"{p}.k_proj.bias": (Hkv * D,)}
        shapes[f"{p}.v_proj.bias"] = (Hkv * D,)
    if cfg.use_qk_norm:
        per_head = cfg.qk_norm_per_head
        shapes[f"{p}.q_norm.weight"] = (D,) if per_head else (H * D,)
        shapes[f"{p}.k_norm.weight"] = (D,) if per_head else (Hkv * D,)
    return shapes


def _mlp_shapes(cfg: ModelConfig, p: str, layer: int) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size

    def gated_mlp(prefix: str, inner: int) -> dict[str, tuple[int, ...]]:
        shapes = {
            f"{prefix}.gate_proj.weight": (inner, h),
            f"{prefix}.up_proj.weight": (inner, h),
            f"{prefix}.down_proj.weight": (h, inner),
        }
        if cfg.mlp_bias:
            shapes |= {f"{prefix}.gate_proj.bias": (inner,), f"{prefix}.up_proj.bias": (inner,)}
            shapes[f"{prefix}.down_proj.bias"] = (h,)
        return shapes

    if not cfg.is_moe_layer(layer):
        return gated_mlp(p, cfg.intermediate_size)
    E, inner = cfg.n_routed_experts, cfg.moe_intermediate_size
    shapes = {
        f"{p}.gate.weight": (E, h),
        f"{p}.experts.gate_proj": (E, inner, h),
        f"{p}.experts.up_proj": (E, inner, h),
        f"{p}.experts.down_proj": (E, h, inner),
    }
    if cfg.n_shared_experts:
        shapes |= gated_mlp(f"{p}.shared_experts", inner * cfg.n_shared_experts)
    return shapes


# A layer's RMSNorms by ModelConfig.norm_placement: before attention, after it, before the MLP,
# after it (None: no norm there). The names are those of Hugging Face's checkpoints.
BLOCK_NORMS = {
    "pre": ("input_layernorm", None, "post_attention_layernorm", None),
    "sandwich": (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
    "post": (None, "post_attention_layernorm", None, "post_feedforward_layernorm"),
}  # fmt: skip


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's key and shape; the single source of truth for init and loading."""
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        attn_in, attn_out, mlp_in, mlp_out = (
            {} if name is None else {f"{p}.{name}.weight": (cfg.hidden_size,)}
            for name in BLOCK_NORMS[cfg.norm_placement]
        )
        shapes |= attn_in | _attention_shapes(cfg, f"{p}.self_attn")
        if cfg.attention_out_bias:
            shapes[f"{p}.self_attn.o_proj.bias"] = (cfg.hidden_size,)
        shapes |= attn_out | mlp_in | _mlp_shapes(cfg, f"{p}.mlp", i) | mlp_out
    shapes["model.norm.weight"] = (cfg.hidden_size,)
    if not cfg.tie_word_embeddings and cfg.model_type == "decoder":
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes


def canonical_order(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Params in the model's own key order (files list keys alphabetically). The order decides
    the summation order of the global gradient norm, so a resumed run must use the same one."""
    order = {k: i for i, k in enumerate(param_shapes(cfg))}
    return dict(sorted(params.items(), key=lambda kv: order.get(kv[0], len(order))))


def init_params(
    cfg: ModelConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Fresh weights: normal(0, initializer_range), output projections scaled down by depth
    (GPT-2 style, so the residual stream does not grow with layers), norms one (their offsets
    from one zero, with rms_norm_unit_offset), biases zero."""
    generator = torch.Generator().manual_seed(seed)
    depth_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    params = {}
    for key, shape in param_shapes(cfg).items():
        if key.endswith(".bias"):
            t = torch.zeros(shape)
        elif key.endswith("norm.weight"):
            t = torch.zeros(shape) if cfg.rms_norm_unit_offset else torch.ones(shape)
        else:
            std = cfg.initializer_range
            if key.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                std *= depth_scale
            t = torch.randn(shape, generator=generator) * std
        params[key] = t.to(device=device, dtype=dtype)
    return params
