"""Log-likelihoods of continuations with `forward`: the scoring under perplexity, multiple
choice and the server's prompt log-probabilities.

A request is a pair (context ids, continuation ids); its score is the log-probability of each
continuation token given everything before it. Long inputs keep their last `max_len` tokens
(the continuation must fit). Requests run in batches sorted by length, so padding stays small;
right padding never changes a causal model's logits at the real positions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from astrai.config import ModelConfig
from astrai.model import forward

Pair = tuple[list[int], list[int]]


class Scored(NamedTuple):
    logprobs: list[float]  # one per continuation token
    greedy: bool  # every continuation token is the model's argmax there
    top: tuple = ()  # per token: the `top` likeliest (id, logprob) pairs, when asked for

    @property
    def total(self) -> float:
        return sum(self.logprobs)


def model_input(context: list[int], continuation: list[int], max_len: int) -> list[int]:
    """The tokens fed to the model: context + continuation without its last token, cut to the
    last max_len."""
    if not context:
        raise ValueError("a continuation needs at least one context token to be scored after")
    if len(continuation) > max_len:
        raise ValueError(f"a continuation of {len(continuation)} tokens exceeds {max_len}")
    return (context + continuation)[:-1][-max_len:]


def rolling_pairs(prefix: int, ids: list[int], max_len: int) -> list[Pair]:
    """Windows that score every token of `ids` exactly once, each with as much context as fits
    in max_len tokens; `prefix` (e.g. the end-of-text token) is the first token's context."""
    full = [prefix, *ids]
    pairs = []
    for start in range(1, len(full), max_len):
        end = min(start + max_len, len(full))
        pairs.append((full[max(0, end - 1 - max_len) : start], full[start:end]))
    return pairs


@torch.inference_mode()
def score_batch(
    params, cfg: ModelConfig, pairs: list[Pair], max_len: int, top: int = 0
) -> list[Scored]:
    """One forward pass over `pairs`, right-padded to the longest; with `top`, the likeliest
    tokens at each continuation position too."""
    inputs = [model_input(c, t, max_len) for c, t in pairs]
    device = next(iter(params.values())).device
    width = max(len(x) for x in inputs)
    tokens = torch.zeros(len(inputs), width, dtype=torch.long)
    for row, x in enumerate(inputs):
        tokens[row, : len(x)] = torch.tensor(x)
    logits = forward(params, cfg, tokens.to(device))
    scored = []
    for row, (x, (_, continuation)) in enumerate(zip(inputs, pairs)):
        n = len(continuation)  # only the continuation's rows: no second [B, T, vocab] tensor
        rows = F.log_softmax(logits[row, len(x) - n : len(x)].float(), dim=-1)
        target = torch.tensor(continuation, device=rows.device)
        picked = rows.gather(-1, target[:, None])[:, 0]
        greedy = bool((rows.argmax(-1) == target).all())
        best = []
        if top:
            values, ids = rows.topk(min(top, rows.shape[-1]), dim=-1)
            best = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
        scored.append(Scored(picked.tolist(), greedy, best))
    return scored


def score_pairs(
    params,
    cfg: ModelConfig,
    pairs: list[Pair],
    batch_size: int,
    max_len: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    top: int = 0,
) -> list[Scored]:
    """Score every pair, longest first in batches of batch_size; results in the given order.
    progress(done, total) is called after each batch; `top` as for `score_batch`."""
    max_len = max_len or cfg.max_position_embeddings
    order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
    out: list[Scored | None] = [None] * len(pairs)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        for i, s in zip(chunk, score_batch(params, cfg, [pairs[i] for i in chunk], max_len, top)):
            out[i] = s
        if progress is not None:
            progress(min(start + batch_size, len(order)), len(order))
    return out
