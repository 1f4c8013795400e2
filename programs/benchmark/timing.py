"""Timing that tolerates a shared machine: sides measured in alternating order, medians, and
ratios taken round by round so drift in the machine's load hits both sides alike."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so a timer measures the work and not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable, device: torch.device) -> tuple[float, object]:
    """(seconds, result) of one call."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def interleave(sides: dict[str, Callable[[int], float]], rounds: int) -> dict[str, list[float]]:
    """Call each side once per round with the round's index; each call returns a rate.

    The order flips every round (A B, B A, A B, ...) so neither side always runs first on a
    warmer or cooler machine.
    """
    names = list(sides)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            rates[name].append(sides[name](r))
    return rates


def median(values: list[float]) -> float:
    return percentile(values, 50)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation (numpy's default), of a non-empty list."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
