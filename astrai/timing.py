"""Timing products against each other on the running machine, the candidates alternating:
inference's layouts as a decode step reads them (each candidate's weights streamed one after
the other), training's float32 libraries (model/products.py)."""

from __future__ import annotations

import time

import torch


def pass_seconds(runs: list, x: torch.Tensor) -> float:
    """Seconds to multiply x by each of the products `runs`, one after the other."""
    start = time.perf_counter()
    for run in runs:
        run(x)
    return time.perf_counter() - start


def best_of_rounds(candidates: dict, seconds) -> dict:
    """Each candidate's best `seconds(candidate)` of three rounds after a warm-up, the
    candidates alternating within a round so that the machine's drift hits them all."""
    for value in candidates.values():
        seconds(value)
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(3):
        for key, value in candidates.items():
            best[key] = min(best[key], seconds(value))
    return best
