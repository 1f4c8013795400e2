"""Packing documents into rows of at most `capacity` tokens, as pure functions of lengths.

A packer takes the token lengths of documents and returns rows: lists of document indices.
Every document lands in exactly one row, in the order the row lists them.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence

import numpy as np


def pack_none(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """One document per row."""
    return [[i] for i in range(len(lengths))]


def pack_greedy(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Next fit in input order: append to the current row, start a new one when it is full."""
    _check_fits(lengths, capacity)
    rows: list[list[int]] = []
    space = 0
    for i, n in enumerate(lengths):
        if not rows or n > space:
            rows.append([])
            space = capacity
        rows[-1].append(i)
        space -= n
    return rows


def pack_bfd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best fit decreasing: longest first, each into the open row it fills most tightly."""
    _check_fits(lengths, capacity)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep input order
    rows: list[list[int]] = []
    spaces: list[tuple[int, int]] = []  # (space left, row) of rows that still have room, sorted
    for i in order:
        n = lengths[i]
        k = bisect_left(spaces, (n, -1))
        if k < len(spaces):
            space, row = spaces.pop(k)
        else:
            space, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if space > n:
            insort(spaces, (space - n, row))
    return rows


PACKERS = {"none": pack_none, "greedy": pack_greedy, "bfd": pack_bfd}


def fit_length(
    ids: np.ndarray, mask: np.ndarray, capacity: int, too_long: str, side: str
) -> list[tuple[np.ndarray, np.ndarray]]:
    """A document as pieces of at most `capacity` tokens: itself, truncated on `side`, split
    into consecutive pieces, or none at all (dropped)."""
    n = len(ids)
    if n <= capacity:
        return [(ids, mask)]
    if too_long == "drop":
        return []
    if too_long == "split":
        return [(ids[s : s + capacity], mask[s : s + capacity]) for s in range(0, n, capacity)]
    keep = slice(0, capacity) if side == "right" else slice(n - capacity, n)
    return [(ids[keep], mask[keep])]


def segment_positions(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """Position ids that count 0, 1, 2, ... within each segment and restart at the next one."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)


def offsets(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """[0, l0, l0 + l1, ...]: where each segment starts, with the total at the end."""
    return np.concatenate([[0], np.cumsum(np.asarray(lengths, dtype=np.int64))]).astype(np.int64)


def _check_fits(lengths: Sequence[int], capacity: int) -> None:
    too_long = [n for n in lengths if n > capacity]
    if too_long:
        raise ValueError(f"a document of {max(too_long)} tokens does not fit rows of {capacity}")
