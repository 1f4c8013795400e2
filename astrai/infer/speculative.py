"""The target's side of speculative decoding: one paged forward over the proposed tokens, and
dropping the K/V of the ones rejected.

A decoding request has fed every token but its last, t, at position `computed`. Verifying its
proposal d_1 .. d_k is a prefill chunk [t, d_1, .., d_k] at positions computed .. computed + k:
it writes their K/V into the request's pages and gives the target's logits after each, the
k + 1 rows acceptance.py reads. If a proposed tokens are accepted, the K/V of t, d_1 .. d_a
are right (each was computed from accepted tokens only) and the rest are not: `discard_after`
keeps the first computed + 1 + a positions. The rejected positions lie past the request's
position, where attention never looks, and are overwritten when it gets there; whole pages
past it go back to the pool. The prefix cache takes only full pages of tokens[:computed]
(scheduler.py), so as long as `computed` counts accepted tokens only, nothing rejected is
ever cached.
"""

from __future__ import annotations

import torch

from astrai.config import ModelConfig
from astrai.infer.paged import Params, prefill_logits
from astrai.infer.pages import Pool, free_pages, page_size_of, pages_for


def verify_forward(
    params: Params,
    cfg: ModelConfig,
    pool: Pool,
    last_tokens: list[int],
    proposed: list[list[int]],
    positions: list[int],
    page_table: torch.Tensor,
    lora: dict | None = None,
) -> tuple[torch.Tensor, Pool]:
    """Feed each request's last token and proposal as one chunk starting at its position.

    last_tokens[b] sits at positions[b]; page_table [B, W] must hold pages up to
    positions[b] + len(proposed[b]). Returns (logits [B, K + 1, vocab] float32, K the longest
    proposal; row b is valid up to len(proposed[b]) + 1), pool. The pool is donated."""
    if not len(last_tokens) == len(proposed) == len(positions) == len(page_table):
        raise ValueError(
            "verify_forward: last_tokens, proposed, positions and page_table need one entry"
            f" per request, got {len(last_tokens)}, {len(proposed)}, {len(positions)},"
            f" {len(page_table)}"
        )
    width = 1 + max(len(p) for p in proposed)
    rows = [[t, *p] + [t] * (width - 1 - len(p)) for t, p in zip(last_tokens, proposed)]
    device = pool["k"].device
    tokens = torch.tensor(rows, dtype=torch.long, device=device)
    lengths = torch.tensor([1 + len(p) for p in proposed], dtype=torch.long, device=device)
    start = torch.tensor(positions, dtype=torch.long, device=device)
    return prefill_logits(params, cfg, pool, tokens, page_table, start, lengths, lora)


def discard_after(pool: Pool, pages: list[int], keep: int) -> tuple[Pool, list[int]]:
    """Keep the K/V of a sequence's first `keep` positions: the pages past the one holding
    position keep - 1 are freed. Returns (pool, the pages kept); the pool is donated."""
    need = pages_for(keep, page_size_of(pool))
    if keep < 0 or need > len(pages):
        raise ValueError(f"keep: {keep} positions do not fit the sequence's {len(pages)} pages")
    if need < len(pages):
        pool = free_pages(pool, pages[need:])
    return pool, pages[:need]
