"""The model as pure functions: tokens and params in, hidden states or logits out."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from astrai.config import ModelConfig
from astrai.model.attention import KVStore, attention_layer, identity_store, kv_shapes
from astrai.model.layers import Params, add_norm, gated_mlp, norm, project
from astrai.model.masked_attention import causal_mask
from astrai.model.moe import moe
from astrai.model.params import BLOCK_NORMS
from astrai.model.rope import rope_tables
from astrai.model.shared_layer import run_shared


def embed(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    neftune_alpha: float = 0.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    x = F.embedding(tokens, params["model.embed_tokens.weight"])
    if cfg.embedding_multiplier != 1.0:
        x = x * _rounded(cfg.embedding_multiplier, x.dtype)
    if neftune_alpha:
        # NEFTune: uniform noise of norm ~alpha / sqrt(T * hidden) regularises fine-tuning.
        T, h = tokens.shape[-1], x.shape[-1]
        noise = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype)
        x = x + (2 * noise - 1) * (neftune_alpha / (T * h) ** 0.5)
    return x


@functools.cache
def _rounded(value: float, dtype: torch.dtype) -> float:
    """value as dtype holds it: Gemma multiplies its embeddings by sqrt(hidden_size) rounded to
    their dtype (in bfloat16, sqrt(640) = 25.298 becomes 25.25)."""
    return torch.tensor(value, dtype=dtype).item()


def document_mask(doc_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """[B, T] document ids -> [B, 1, T, T] bool mask: attend only within one's own document."""
    mask = doc_ids[:, :, None] == doc_ids[:, None, :]
    if causal:
        T = doc_ids.shape[1]
        mask = mask & causal_mask(T, T, doc_ids.device)
    return mask[:, None]


def window_mask(
    mask: torch.Tensor | None, query_pos: torch.Tensor, key_pos: torch.Tensor, window: int
) -> torch.Tensor:
    """mask (bool [..., T, S], or None for plain causal attention over T == S) narrowed to the
    keys fewer than `window` positions behind their query. query_pos [..., T], key_pos [S]."""
    behind = query_pos[..., :, None] - key_pos
    near = behind < window
    return near & (behind >= 0) if mask is None else mask & near


def decode_layers(
    params: Params,
    cfg: ModelConfig,
    x: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None = None,
    kv_store: KVStore = identity_store,
    lora: dict | None = None,
    checkpoint: bool = False,
    sliding: torch.Tensor | None = None,
    compiled_layer=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run every layer over embeddings x [B, T, hidden] -> (final normed hidden, MoE aux loss).

    mask: bool [B, 1, T, S] (True = may attend) or None for plain causal (decoder) or full
    (encoder) attention over the T new tokens. kv_store decides what the layers attend over.
    sliding: the mask of the sliding-window layers (see window_mask). Not given, the T tokens
    attend among themselves and the window counts their indices.
    compiled_layer: compile_layer()'s function, to run every layer through one compiled graph
    (astrai/model/shared_layer.py); only over the new tokens (the identity KV store).
    """
    if compiled_layer is not None and (checkpoint or kv_store is not identity_store):
        raise ValueError("compiled_layer runs without checkpointing and without a KV store")
    causal = cfg.model_type == "decoder"
    if cfg.has_sliding_layers and sliding is None:
        T = x.shape[1]
        if mask is not None and mask.shape[-1] != T:
            raise ValueError("attending over stored keys, sliding-window layers need sliding=")
        steps = torch.arange(T, device=x.device)
        sliding = window_mask(mask, steps, steps, cfg.sliding_window)
        sliding = sliding if mask is not None else sliding[None, None]
    rope = rope_tables(cfg, positions)
    local = rope if cfg.rope_local_base_freq is None else rope_tables(cfg, positions, local=True)
    aux = x.new_zeros((), dtype=torch.float32)
    for i in range(cfg.num_hidden_layers):
        slides = sliding is not None and cfg.is_sliding_layer(i)
        layer_mask, layer_rope = (sliding, local) if slides else (mask, rope)
        layer_rope = None if i in cfg.nope_layers else layer_rope
        args = (params, cfg, i, x, layer_rope, kv_store, layer_mask, causal, lora)
        if compiled_layer is not None:
            rest = (x, layer_rope, kv_store, layer_mask, causal)
            x, layer_aux = run_shared(compiled_layer, params, cfg, i, *rest, lora=lora)
        elif checkpoint:
            x, layer_aux = torch.utils.checkpoint.checkpoint(_layer, *args, use_reentrant=False)
        else:
            x, layer_aux = _layer(*args)
        if layer_aux is not None:  # dense layers add nothing: two ops a layer saved
            aux = aux + layer_aux
    return norm(params, cfg, "model.norm.weight", x), aux


def compile_layer():
    """A fresh torch.compile of one decoder layer, for decode_layers(compiled_layer=): shapes
    static, and the graph whole (a break would run the layer eagerly without a word)."""
    return torch.compile(_layer, dynamic=False, fullgraph=True)


def _layer(params, cfg, i, x, rope, kv_store, mask, causal, lora):
    """One decoder layer: (x after it, its MoE aux loss or None for a dense layer)."""
    p = f"model.layers.{i}"
    attn_in, attn_out, mlp_in, mlp_out = BLOCK_NORMS[cfg.norm_placement]
    h = x if attn_in is None else norm(params, cfg, f"{p}.{attn_in}.weight", x)
    h = attention_layer(params, cfg, i, h, rope, kv_store, mask, causal, lora)
    y = _block_output(params, cfg, p, attn_out, h)
    if mlp_in is None:
        x = h = x + y
    else:
        x, h = add_norm(params, cfg, f"{p}.{mlp_in}.weight", x, y)
    if cfg.is_moe_layer(i):
        y, aux = moe(params, cfg, f"{p}.mlp", h, lora)
    else:
        y, aux = gated_mlp(params, f"{p}.mlp", h, lora, cfg.hidden_act), None
    return x + _block_output(params, cfg, p, mlp_out, y), aux


def _block_output(params: Params, cfg: ModelConfig, prefix: str, name: str | None, y):
    """What a block adds to the residual stream: y through its output norm `name` (None: the
    placement puts none there), times the residual multiplier (Granite)."""
    if name is not None:
        y = norm(params, cfg, f"{prefix}.{name}.weight", y)
    return y if cfg.residual_multiplier == 1.0 else y * cfg.residual_multiplier


def lm_head(params: Params, cfg: ModelConfig, hidden: torch.Tensor) -> torch.Tensor:
    weight = params.get("lm_head.weight", params["model.embed_tokens.weight"])
    logits = project(hidden, weight)
    if cfg.logits_scaling != 1.0:
        logits = logits / cfg.logits_scaling
    if cfg.final_logit_softcapping is not None:
        cap = cfg.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


def default_positions(tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
    T = tokens.shape[-1]
    return torch.arange(start, start + T, device=tokens.device).expand(tokens.shape)


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    lora: dict | None = None,
    return_aux: bool = False,
    neftune_alpha: float = 0.0,
    generator: torch.Generator | None = None,
    checkpoint: bool = False,
    compiled_layer=None,
):
    """tokens [B, T] -> logits [B, T, vocab] (and the MoE aux loss when return_aux).

    positions [B, T] default to 0..T-1; doc_ids [B, T] restrict attention to each document
    of a packed sequence; mask is an explicit bool [B, 1, T, T] (True = may attend).
    compiled_layer: compile_layer()'s function, run for every layer (see decode_layers).
    """
    hidden, aux = hidden_states(
        params,
        cfg,
        tokens,
        positions,
        mask,
        doc_ids,
        lora,
        neftune_alpha,
        generator,
        checkpoint,
        compiled_layer,
    )
    logits = lm_head(params, cfg, hidden)
    return (logits, aux) if return_aux else logits


def hidden_states(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    positions: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    lora: dict | None = None,
    neftune_alpha: float = 0.0,
    generator: torch.Generator | None = None,
    checkpoint: bool = False,
    compiled_layer=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward` up to its head: (final normed hidden [B, T, hidden], MoE aux loss)."""
    if positions is None:
        positions = default_positions(tokens)
    if doc_ids is not None:
        mask = document_mask(doc_ids, cfg.model_type == "decoder")
    x = embed(params, cfg, tokens, neftune_alpha, generator)
    return decode_layers(
        params,
        cfg,
        x,
        positions,
        mask,
        lora=lora,
        checkpoint=checkpoint,
        compiled_layer=compiled_layer,
    )


# --- a contiguous KV cache for incremental decoding ------------------------------------


def init_cache(
    cfg: ModelConfig,
    batch: int,
    max_len: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """{"k": [L, B, max_len, *k], "v": [L, B, max_len, *v]} (shapes from kv_shapes)."""
    k_shape, v_shape = kv_shapes(cfg)
    L = cfg.num_hidden_layers
    return {
        "k": torch.zeros(L, batch, max_len, *k_shape, dtype=dtype, device=device),
        "v": torch.zeros(L, batch, max_len, *v_shape, dtype=dtype, device=device),
    }


def forward_cached(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    cache: dict[str, torch.Tensor],
    start: int,
    lora: dict | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Feed tokens [B, T] at positions start..start+T-1, attending over the cached prefix.

    The cache is donated: it is written in place and returned; do not reuse the old one.
    """
    T = tokens.shape[1]
    end = start + T

    def store(layer, k_new, v_new):
        cache["k"][layer, :, start:end] = k_new.to(cache["k"].dtype)
        cache["v"][layer, :, start:end] = v_new.to(cache["v"].dtype)
        return cache["k"][layer, :, :end], cache["v"][layer, :, :end]

    key_pos = torch.arange(end, device=tokens.device)
    query_pos = torch.arange(start, end, device=tokens.device)
    mask = (key_pos[None, :] <= query_pos[:, None])[None, None]
    sliding = None
    if cfg.has_sliding_layers:
        sliding = window_mask(mask, query_pos, key_pos, cfg.sliding_window)
    x = embed(params, cfg, tokens)
    positions = default_positions(tokens, start)
    hidden, _ = decode_layers(
        params, cfg, x, positions, mask, kv_store=store, lora=lora, sliding=sliding
    )
    return lm_head(params, cfg, hidden), cache


# --- the embedding encoder -------------------------------------------------------------


def encode(
    params: Params,
    cfg: ModelConfig,
    tokens: torch.Tensor,
    mask: torch.Tensor | None = None,
    pooling: str = "mean",
    normalize: bool = True,
) -> torch.Tensor:
    """tokens [B, T], mask [B, T] (1 = real token) -> embeddings [B, hidden].

    Attention is bidirectional for encoders (model_type "encoder"), causal otherwise.
    """
    if mask is None:
        mask = torch.ones_like(tokens, dtype=torch.bool)
    mask = mask.bool()
    attn = mask[:, None, None, :]
    if cfg.model_type == "decoder":
        T = tokens.shape[1]
        attn = attn & causal_mask(T, T, tokens.device)
    # A padded query row that sees nothing would give NaN; let it see itself.
    attn = attn | torch.eye(tokens.shape[1], dtype=torch.bool, device=tokens.device)
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden, _ = decode_layers(params, cfg, embed(params, cfg, tokens), positions, attn)
    match pooling:
        case "mean":
            weights = mask[..., None].to(hidden.dtype)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
        case "last":
            last = mask.long().sum(-1).clamp(min=1) - 1
            pooled = hidden[torch.arange(hidden.shape[0]), last]
        case "cls":
            pooled = hidden[:, 0]
        case _:
            raise ValueError(f"pooling must be 'mean', 'last' or 'cls', got {pooling!r}")
    return F.normalize(pooled, dim=-1) if normalize else pooled
