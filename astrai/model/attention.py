"""Attention layers: grouped-query attention (GQA) and multi-latent attention (MLA).

Each kind is two functions. `*_qkv` projects the new tokens into queries and the per-token
K/V entries worth storing; `*_out` attends over all stored entries and projects back. Between
them sits a KV store (see docs/architecture.md), so one layer serves training, a contiguous
cache and the paged pool alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from astrai.config import ModelConfig
from astrai.kernels.paged_attention import PagedMask, decode_attention
from astrai.model.layers import Params, attend, fused_linear, linear, norm
from astrai.model.rope import apply_rope

# (layer, new keys, new values) -> what the layer attends over. Called with None, None where a
# PagedMask has the kernel write the new entries itself: the stored entries, nothing added.
KVStore = Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def kv_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-token shapes of the stored "k" and "v" entries."""
    if cfg.attn_type == "mla":
        return (cfg.kv_lora_rank,), (cfg.qk_rope_head_dim,)
    return (cfg.kv_heads, cfg.dim_per_head), (cfg.kv_heads, cfg.dim_per_head)


def identity_store(
    layer: int, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return k, v


# --- grouped-query attention -------------------------------------------------------------


def gqa_qkv(params: Params, cfg: ModelConfig, prefix: str, x, rope, lora):
    """rope: the (cos, sin) tables, or None in a layer without RoPE."""
    B, T, _ = x.shape
    H, Hkv, D = cfg.num_attention_heads, cfg.kv_heads, cfg.dim_per_head
    if rope is not None:
        cos, sin = rope[0].unsqueeze(2), rope[1].unsqueeze(2)  # one table for every head
    plain = not (cfg.use_gated_attention or cfg.use_qk_norm or lora)
    if plain and f"{prefix}.qkv_proj.weight" in params:
        # Fused inference weights give queries and keys side by side: rotating them as one
        # tensor saves five of a decode step's ~70 small ops a layer.
        qk, v = linear(params, f"{prefix}.qkv_proj", x).split_with_sizes(
            [(H + Hkv) * D, Hkv * D], dim=-1
        )
        qk = qk.view(B, T, H + Hkv, D)
        q, k = (qk if rope is None else apply_rope(qk, cos, sin)).split_with_sizes([H, Hkv], 2)
        return q, k, v.view(B, T, Hkv, D), None
    q, k, v = fused_linear(params, prefix, "qkv_proj", x, lora, (None, Hkv * D, Hkv * D))
    if cfg.use_qk_norm and not cfg.qk_norm_per_head:  # OLMo 2: all heads at once
        q = norm(params, cfg, f"{prefix}.q_norm.weight", q)
        k = norm(params, cfg, f"{prefix}.k_norm.weight", k)
    q = q.reshape(B, T, H, -1)
    gate = None
    if cfg.use_gated_attention:
        q, gate = q.split(D, dim=-1)
    k = k.reshape(B, T, Hkv, D)
    v = v.reshape(B, T, Hkv, D)
    if cfg.use_qk_norm and cfg.qk_norm_per_head:
        q = norm(params, cfg, f"{prefix}.q_norm.weight", q)
        k = norm(params, cfg, f"{prefix}.k_norm.weight", k)
    if rope is None:
        return q, k, v, gate
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, gate


def gqa_out(params: Params, cfg: ModelConfig, prefix: str, q, k, v, mask, causal, gate, lora):
    B, T = q.shape[:2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    o = attend(q, k, v, mask, causal, cfg.attention_scale, cfg.attn_logit_softcapping)
    o = o.transpose(1, 2)
    if gate is not None:
        o = o * torch.sigmoid(gate)
    return linear(params, f"{prefix}.o_proj", o.reshape(B, T, -1), lora)


# --- multi-latent attention ----------------------------------------------------------------


def mla_scale(cfg: ModelConfig) -> float:
    scale = 1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type == "yarn" and rs.mscale_all_dim:
        m = 0.1 * rs.mscale_all_dim * math.log(rs.factor) + 1.0 if rs.factor > 1 else 1.0
        scale *= m * m
    return scale


def mla_qkv(params: Params, cfg: ModelConfig, prefix: str, x, rope, lora):
    B, T, _ = x.shape
    cos, sin = rope
    if cfg.q_lora_rank:
        q = linear(params, f"{prefix}.q_a_proj", x, lora)
        q = norm(params, cfg, f"{prefix}.q_a_layernorm.weight", q)
        q = linear(params, f"{prefix}.q_b_proj", q, lora)
    else:
        q = linear(params, f"{prefix}.q_proj", x, lora)
    q = q.view(B, T, cfg.num_attention_heads, -1)
    q_nope, q_rope = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
    latent, k_rope = linear(params, f"{prefix}.kv_a_proj_with_mqa", x, lora).split(
        [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1
    )
    latent = norm(params, cfg, f"{prefix}.kv_a_layernorm.weight", latent)
    # What MLA stores per token: the normalised latent and one rotated key shared by all heads.
    return q, latent, apply_rope(k_rope, cos, sin), None


def mla_out(
    params: Params, cfg: ModelConfig, prefix: str, q, latent, k_rope, mask, causal, gate, lora
):
    B, T, H, _ = q.shape
    S = latent.shape[1]
    kv = linear(params, f"{prefix}.kv_b_proj", latent, lora).view(B, S, H, -1)
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_rope[:, :, None].expand(B, S, H, -1)], dim=-1)
    o = attend(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, causal, mla_scale(cfg)
    )
    return linear(params, f"{prefix}.o_proj", o.transpose(1, 2).reshape(B, T, -1), lora)


ATTENTION = {"gqa": (gqa_qkv, gqa_out), "mla": (mla_qkv, mla_out)}


def attention_layer(
    params: Params,
    cfg: ModelConfig,
    layer: int,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    kv_store: KVStore,
    mask: torch.Tensor | None,
    causal: bool,
    lora: dict | None = None,
) -> torch.Tensor:
    qkv, out = ATTENTION[cfg.attn_type]
    prefix = f"model.layers.{layer}.self_attn"
    if (
        isinstance(mask, PagedMask)
        and mask.slots is not None
        and _plain(params, cfg, prefix, rope, lora)
    ):
        return _decode_in_pages(params, cfg, prefix, layer, x, rope, kv_store, mask)
    q, k_new, v_new, gate = qkv(params, cfg, prefix, x, rope, lora)
    k, v = kv_store(layer, k_new, v_new)
    return out(params, cfg, prefix, q, k, v, mask, causal, gate, lora)


def _plain(params: Params, cfg: ModelConfig, prefix: str, rope, lora) -> bool:
    """Whether the layer is grouped-query attention of a fused q/k/v product and nothing more
    (no gate, no q/k norm, no adapter, RoPE over whole heads or none): decode_attention's."""
    return (
        cfg.attn_type == "gqa"
        and not (cfg.use_gated_attention or cfg.use_qk_norm or lora)
        and f"{prefix}.qkv_proj.weight" in params
        and (rope is None or rope[0].shape[-1] == cfg.dim_per_head)
    )


def _decode_in_pages(params, cfg, prefix, layer, x, rope, kv_store, mask) -> torch.Tensor:
    """A plain layer's decode step with its attention in one C call, which rotates the new
    query and key, writes the new key and value to the pages and attends over them."""
    k_pages, v_pages = kv_store(layer, None, None)
    qkv = linear(params, f"{prefix}.qkv_proj", x)
    o = decode_attention(
        qkv, rope, k_pages, v_pages, mask, cfg.num_attention_heads, cfg.attention_scale
    )
    return linear(params, f"{prefix}.o_proj", o)
