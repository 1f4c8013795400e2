"""Batches as a pure function of an explicit cursor: `cursor, batch = next_batch(data, cursor)`.

Each epoch visits the examples in an order fixed by (seed, epoch). With `world_size` ranks, rank
r reads the r-th of `world_size` equal, disjoint slices of that order (the `n % world_size`
examples left over are skipped that epoch; the next epoch's order differs). A batch that runs
past the end of an epoch is completed from the start of the next one, so every batch is full
and every rank takes the same number of steps.
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import msgspec
import numpy as np
import torch

from astrai.data.datasets import IGNORE, Dataset, get_example


class Cursor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where reading stands. Plain data: `msgspec.to_builtins(cursor)` is JSON-able."""

    batch_size: int
    seed: int = 0
    epoch: int = 0
    position: int = 0  # examples already read from this rank's slice of this epoch
    rank: int = 0
    world_size: int = 1
    shuffle: bool = True

    def __post_init__(self) -> None:
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..world_size-1 ({self.world_size})")
        if self.seed < 0 or self.epoch < 0 or self.position < 0:
            raise ValueError("seed, epoch and position must not be negative")


C = TypeVar("C", Cursor, dict)


def as_cursor(cursor: Cursor | dict[str, Any]) -> Cursor:
    return cursor if isinstance(cursor, Cursor) else msgspec.convert(cursor, Cursor)


@functools.lru_cache(maxsize=4)
def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """The order of examples 0..n-1 in an epoch; the same for every rank and every run."""
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    order.flags.writeable = False  # shared through the cache
    return order


def rank_order(n: int, cursor: Cursor, epoch: int) -> np.ndarray:
    """This rank's slice of the epoch's order."""
    per_rank = n // cursor.world_size
    start = cursor.rank * per_rank
    return epoch_order(n, cursor.seed, epoch, cursor.shuffle)[start : start + per_rank]


def next_indices(n: int, cursor: C) -> tuple[C, np.ndarray]:
    """The example indices of this rank's next batch, and the cursor after it."""
    c = as_cursor(cursor)
    per_rank = n // c.world_size
    if per_rank == 0:
        raise ValueError(f"{n} examples cannot be shared among {c.world_size} ranks")
    epoch, position, taken = c.epoch, c.position, []
    while sum(len(t) for t in taken) < c.batch_size:
        if position >= per_rank:
            epoch, position = epoch + 1, 0
        take = min(c.batch_size - sum(len(t) for t in taken), per_rank - position)
        taken.append(rank_order(n, c, epoch)[position : position + take])
        position += take
    if position >= per_rank:  # an epoch just ended: say so in the cursor
        epoch, position = epoch + 1, 0
    after = msgspec.structs.replace(c, epoch=epoch, position=position)
    return _same_type(cursor, after), np.concatenate(taken)


def next_batch(data: Dataset, cursor: C) -> tuple[C, dict[str, Any]]:
    """The next batch of this rank and the cursor after it (a dict cursor gives a dict back)."""
    cursor, indices = next_indices(len(data), cursor)
    return cursor, collate(data, [get_example(data, int(i)) for i in indices])


def collate(data: Dataset, examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stack examples into torch tensors of [B, max_seq_len], padding ids with the pad id,
    labels with -100, positions with 0 and doc_ids with an id of their own."""
    if data.kind == "grpo":
        return {
            "prompt_ids": [e["prompt_ids"] for e in examples],
            "records": [e["record"] for e in examples],
        }
    T, pad = data.max_seq_len, data.index["pad_id"]
    fills = {"input_ids": pad, "labels": IGNORE, "positions": 0}
    fills.update({f"{n}_ids": pad for n in ("chosen", "rejected")})
    fills.update({f"{n}_labels": IGNORE for n in ("chosen", "rejected")})
    batch = {}
    for key in examples[0]:
        out = np.full((len(examples), T), fills.get(key, 0), dtype=np.int64)
        for b, e in enumerate(examples):
            values = e[key]
            out[b, : len(values)] = values
            if key == "doc_ids":
                out[b, len(values) :] = values.max(initial=-1) + 1  # padding: a document of its own
        batch[key] = torch.from_numpy(out)
    return batch


def cursor_dict(cursor: Cursor) -> dict[str, Any]:
    return msgspec.to_builtins(cursor)


def _same_type(original: Any, cursor: Cursor) -> Any:
    return cursor_dict(cursor) if isinstance(original, dict) else cursor
