"""What a speculative proposer hands the verifier: up to k next tokens for one request.

Any function that returns a `Proposal` per request is a proposer (prompt lookup in lookup.py,
a draft model in draft.py). The verifier (acceptance.py) needs to know, for each proposed
token, the distribution it was drawn from, because rejection sampling accepts a token with
probability min(1, p/q). A proposer that picks its tokens deterministically (lookup, a greedy
draft) leaves `probs` out: its q is one-hot on the token it chose.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Proposal(NamedTuple):
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab], each row summing to 1


def check_proposal(proposal: Proposal, vocab_size: int) -> None:
    """Raise a ValueError naming the field when a proposal cannot be verified."""
    tokens, probs = proposal
    if any(not 0 <= t < vocab_size for t in tokens):
        raise ValueError(f"Proposal.tokens: ids must lie in [0, {vocab_size}), got {tokens}")
    if probs is not None and tuple(probs.shape) != (len(tokens), vocab_size):
        raise ValueError(
            f"Proposal.probs: expected shape ({len(tokens)}, {vocab_size}),"
            f" got {tuple(probs.shape)}"
        )
