"""Rotary position embeddings, with the context-extension schemes Hugging Face names.

`rope_tables(cfg, positions)` gives the cos/sin tables for any positions, so training,
cached decoding and paged serving all rotate with the same numbers.
"""

from __future__ import annotations

import math

import torch

from astrai.config import ModelConfig
from astrai.model.layers import cast


def rope_dim(cfg: ModelConfig) -> int:
    return cfg.qk_rope_head_dim if cfg.attn_type == "mla" else cfg.rotary_dim


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_frequencies(
    cfg: ModelConfig, seq_len: int, local: bool = False
) -> tuple[torch.Tensor, float]:
    """Per-pair rotation frequencies and the attention factor that scales cos/sin; local: those
    of the sliding layers, by their own base and unscaled (Gemma 3)."""
    dim, base = rope_dim(cfg), cfg.rope_local_base_freq if local else cfg.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv_freq = 1.0 / base**exponents
    rs = None if local else cfg.rope_scaling
    if rs is None or rs.rope_type == "default":
        return inv_freq.float(), 1.0
    original = rs.original_max_position_embeddings or cfg.max_position_embeddings
    match rs.rope_type:
        case "linear":
            return (inv_freq / rs.factor).float(), 1.0
        case "dynamic":
            # NTK-aware: stretch the base only once the sequence outgrows the trained context.
            if seq_len > original:
                base = base * ((rs.factor * seq_len / original) - (rs.factor - 1)) ** (
                    dim / (dim - 2)
                )
                inv_freq = 1.0 / base**exponents
            return inv_freq.float(), 1.0
        case "yarn":
            return _yarn(inv_freq, dim, base, rs, original)
        case "llama3":
            return _llama3(inv_freq, rs, original).float(), 1.0
        case "longrope":
            return _longrope(inv_freq, rs, original, seq_len)
    raise ValueError(f"unknown rope_scaling.rope_type {rs.rope_type!r}")


def _yarn(inv_freq, dim, base, rs, original) -> tuple[torch.Tensor, float]:
    if rs.attention_factor is not None:
        attention_factor = rs.attention_factor
    elif rs.mscale and rs.mscale_all_dim:
        attention_factor = _yarn_mscale(rs.factor, rs.mscale) / _yarn_mscale(
            rs.factor, rs.mscale_all_dim
        )
    else:
        attention_factor = _yarn_mscale(rs.factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 keeps the original frequency, 0 interpolates fully
    blended = inv_freq / rs.factor * (1 - extrapolate) + inv_freq * extrapolate
    return blended.float(), attention_factor


def _longrope(inv_freq, rs, original, seq_len) -> tuple[torch.Tensor, float]:
    """Phi-3: each frequency divided by a factor of its own, the long ones for a sequence
    reaching past the original context (see _longrope_rows); cos and sin scaled by
    sqrt(1 + ln(factor) / ln(original)) unless given."""
    factors = rs.long_factor if seq_len > original else rs.short_factor
    attention_factor = rs.attention_factor
    if attention_factor is None:
        scaled = rs.factor > 1.0
        attention_factor = (
            math.sqrt(1 + math.log(rs.factor) / math.log(original)) if scaled else 1.0
        )
    return (inv_freq / torch.tensor(factors, dtype=torch.float64)).float(), attention_factor


def _longrope_rows(cfg: ModelConfig, positions: torch.Tensor, short: torch.Tensor) -> torch.Tensor:
    """LongRoPE's frequencies per row of positions [..., T] -> [..., 1, rope_dim / 2]: the long
    ones for a row that reaches past the original context. transformers decides once per call,
    which is the same for one sequence; by row, a request's numbers do not depend on the
    requests it is batched with."""
    original = cfg.rope_scaling.original_max_position_embeddings or cfg.max_position_embeddings
    long, _ = inv_frequencies(cfg, original + 1)
    past = positions.amax(-1, keepdim=True)[..., None] >= original
    return torch.where(past, long.to(short.device), short)


def _llama3(inv_freq, rs, original) -> torch.Tensor:
    low_wavelen = original / rs.low_freq_factor
    high_wavelen = original / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (original / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(
    cfg: ModelConfig, positions: torch.Tensor, local: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [*positions.shape, rope_dim] in float32, for half-split pairs as Hugging
    Face rotates them. The first half of sin is negated, so that `apply_rope` needs no sign flip.
    local: the tables of the sliding layers (see inv_frequencies)."""
    # only dynamic NTK depends on the length; reading it elsewhere would sync (and break
    # torch.compile's graph) for nothing
    kind = None if local or cfg.rope_scaling is None else cfg.rope_scaling.rope_type
    seq_len = int(positions.max()) + 1 if kind == "dynamic" and positions.numel() else 1
    inv_freq, factor = inv_frequencies(cfg, seq_len, local)
    inv_freq = inv_freq.to(positions.device)
    if kind == "longrope":
        inv_freq = _longrope_rows(cfg, positions, inv_freq)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    cos, sin = angles.cos() * factor, angles.sin() * factor
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, T, H, D] (or [B, T, D]) by the tables of `rope_tables` [B, T, D] (or
    [B, T, 1, D], unsqueezed once for all the heads of x). Tables narrower than the heads rotate
    their first dimensions and pass the rest (partial_rotary_factor)."""
    if cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    if (rotated := cos.shape[-1]) < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]], dim=-1)
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): rolling by half swaps the halves and the
    # table carries the sign, three ops where a decode step is bound by the count of small ops.
    return cast(torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin), x.dtype)
