"""Paged prefill and decode: the model's layers attending over K/V stored in the page pool.

A page table row lists the pages of one sequence in order: token position p lives in page
`page_table[b, p // page_size]` at offset `p % page_size`. Entries past a sequence's end may
hold any valid page index; the attention mask hides them.

Both functions donate the pool: new K/V are written into its buffers in place with index
operations, and the pool comes back. Use the returned pool: the one passed in is emptied.
"""

from __future__ import annotations

import torch

from astrai.config import ModelConfig
from astrai.infer.fused_layers import fused_layers
from astrai.infer.pages import Pool, page_size_of, passed_on
from astrai.kernels.paged_attention import PagedMask, runs_here
from astrai.model import Params, decode_layers, embed, lm_head
from astrai.model.forward import window_mask
from astrai.model.layers import cast


def _paged_layers(params, cfg, pool, tokens, positions, page_table, valid, lora):
    """Run the layers over tokens [B, T] at positions [B, T], writing the K/V of the valid
    tokens into the pool and attending over each sequence's pages up to its position."""
    ps = page_size_of(pool)
    device = pool["k"].device
    num_slots = pool["k"].shape[1] * ps
    width = page_table.shape[1]
    # Only the pages that some sequence in the batch reaches are gathered.
    used = int(positions.max()) // ps + 1
    if used > width:
        raise ValueError(f"position {int(positions.max())} is past the page table ({width} pages)")
    table = page_table[:, :used].to(device=device, dtype=torch.long)
    slots = table.gather(1, positions // ps) * ps + positions % ps
    slots = slots[valid] if valid is not None else slots.flatten()
    x = embed(params, cfg, tokens)
    if lora is None:  # every layer in one C call, where it takes the model and the chunk
        hidden = fused_layers(params, cfg, pool, x, positions, table, slots, valid)
        if hidden is not None:
            return hidden
    in_place = _reads_pages_in_place(cfg, pool, tokens)
    if in_place:
        mask, sliding = _paged_masks(cfg, table, positions, slots)
    else:
        mask, sliding = _dense_masks(cfg, positions, used * ps, x.dtype)

    def store(layer, k_new, v_new):
        k_layer, v_layer = pool["k"][layer], pool["v"][layer]
        if k_new is None:  # decode_attention writes the new entries itself
            return k_layer, v_layer
        k_rows = k_new[valid] if valid is not None else k_new.flatten(0, 1)
        v_rows = v_new[valid] if valid is not None else v_new.flatten(0, 1)
        k_layer.view(num_slots, *k_layer.shape[2:]).index_copy_(
            0, slots, cast(k_rows, k_layer.dtype)
        )
        v_layer.view(num_slots, *v_layer.shape[2:]).index_copy_(
            0, slots, cast(v_rows, v_layer.dtype)
        )
        if in_place:  # [pages, page_size, Hkv, D]: token-major, as the gathered keys would be
            return k_layer, v_layer
        # index_select with a flat index costs half what indexing with the [B, used] table does
        B, flat_table = table.shape[0], table.flatten()
        k_all = k_layer.index_select(0, flat_table).view(B, used * ps, *k_layer.shape[2:])
        v_all = v_layer.index_select(0, flat_table).view(B, used * ps, *v_layer.shape[2:])
        return cast(k_all, k_new.dtype), cast(v_all, v_new.dtype)

    hidden, _ = decode_layers(params, cfg, x, positions, mask, store, lora, sliding=sliding)
    return hidden


def _reads_pages_in_place(cfg: ModelConfig, pool: Pool, tokens: torch.Tensor) -> bool:
    """Whether attention reads the pool's pages where they lie (our C kernel, PagedMask):
    decoding one token a sequence, GQA without capped scores, on a CPU where the kernel runs."""
    return (
        tokens.shape[1] == 1
        and cfg.attn_type == "gqa"
        and cfg.attn_logit_softcapping is None
        and runs_here(pool["k"].dtype, cfg.dim_per_head, pool["k"].device)
    )


def _paged_masks(cfg: ModelConfig, table: torch.Tensor, positions: torch.Tensor, slots):
    """(mask, sliding-window mask or None) for attention over the pages in place, with the
    slots of the new tokens (a plain layer's kernel writes them itself). The table is made
    contiguous here, once a step, not by the kernel's wrapper in every layer (a slice of a
    wider page table is not)."""
    table, keys = table.contiguous(), positions[:, 0] + 1
    sliding = PagedMask(table, keys, cfg.sliding_window, slots) if cfg.has_sliding_layers else None
    return PagedMask(table, keys, 0, slots), sliding


def _dense_masks(cfg: ModelConfig, positions: torch.Tensor, keys: int, dtype: torch.dtype):
    """(mask, sliding-window mask or None), additive [B, 1, T, keys], for attention over the
    pages gathered into one sequence of keys per row."""
    key_pos = torch.arange(keys, device=positions.device)
    visible = (key_pos[None, None, :] <= positions[:, :, None])[:, None]
    sliding = None
    if cfg.has_sliding_layers:  # the pages hold every position; the mask hides the old ones
        sliding = _additive(
            window_mask(visible, positions[:, None], key_pos, cfg.sliding_window), dtype
        )
    return _additive(visible, dtype), sliding


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as 0 / -inf, made once a step: SDPA spends three ops a layer turning a bool
    mask into this."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        visible.logical_not(), float("-inf")
    )


def _chunk(tokens, start_pos, lengths):
    """Positions [B, T] of a right-padded batch of chunks, the mask of real tokens (None when
    every row is full) and each row's last real index [B]."""
    B, T = tokens.shape
    device = tokens.device
    start = torch.as_tensor(start_pos, dtype=torch.long, device=device).expand(B)
    positions = start[:, None] + torch.arange(T, device=device)
    valid = None
    last = torch.full((B,), T - 1, dtype=torch.long, device=device)
    if lengths is not None:
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=device)
        if bool((lengths < T).any()):
            valid = torch.arange(T, device=device)[None, :] < lengths[:, None]
            # padded rows sit at their row's last real position: they see only real keys
            positions = torch.minimum(positions, (start + lengths - 1)[:, None])
        last = lengths - 1
    return positions, valid, last


def prefill(
    params: Params,
    cfg: ModelConfig,
    pool: Pool,
    tokens: torch.Tensor,
    page_table: torch.Tensor,
    start_pos: torch.Tensor | int,
    lengths: torch.Tensor | None = None,
    lora: dict | None = None,
) -> tuple[torch.Tensor, Pool]:
    """Feed a batch of prompt chunks and return the logits after each chunk's last token.

    tokens [B, T] (right-padded; `lengths` [B] gives each row's real length, default T);
    page_table [B, W] must already hold pages for positions start_pos .. start_pos + length - 1;
    start_pos (int or [B]) is where each chunk begins, e.g. after a cached prefix or an earlier
    chunk. Returns (logits [B, vocab] float32, pool). The pool is donated.
    """
    positions, valid, last = _chunk(tokens, start_pos, lengths)
    hidden = _paged_layers(params, cfg, pool, tokens, positions, page_table, valid, lora)
    hidden = hidden[torch.arange(len(tokens), device=tokens.device), last]
    return lm_head(params, cfg, hidden).float(), passed_on(pool, "prefill")


def prefill_logits(
    params: Params,
    cfg: ModelConfig,
    pool: Pool,
    tokens: torch.Tensor,
    page_table: torch.Tensor,
    start_pos: torch.Tensor | int,
    lengths: torch.Tensor | None = None,
    lora: dict | None = None,
) -> tuple[torch.Tensor, Pool]:
    """`prefill`, returning the logits after every token of each chunk: [B, T, vocab] float32
    (a padded position repeats its row's last real one). Verifying speculated tokens needs
    the target's distribution at each of them. The pool is donated."""
    positions, valid, _ = _chunk(tokens, start_pos, lengths)
    hidden = _paged_layers(params, cfg, pool, tokens, positions, page_table, valid, lora)
    B, T = tokens.shape
    # the packed weight layouts take rows, not [B, T] batches
    logits = lm_head(params, cfg, hidden.flatten(0, 1)).float().view(B, T, -1)
    return logits, passed_on(pool, "prefill_logits")


def decode_step(
    params: Params,
    cfg: ModelConfig,
    pool: Pool,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    page_table: torch.Tensor,
    lora: dict | None = None,
) -> tuple[torch.Tensor, Pool]:
    """One new token per sequence: tokens [B] at positions [B] -> (logits [B, vocab], pool).

    page_table [B, W] must already hold the page for each position. The pool is donated."""
    hidden = _paged_layers(
        params, cfg, pool, tokens[:, None], positions[:, None], page_table, None, lora
    )
    return lm_head(params, cfg, hidden[:, 0]).float(), passed_on(pool, "decode_step")
