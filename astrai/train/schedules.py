"""Learning-rate schedules as pure functions of the step: `lr_at(step, sched, peak, total)`.

`step` counts optimizer steps from 0; `total` is the run's max_steps. Every schedule warms up
linearly over `warmup_steps` from `peak / warmup_steps` and ends at `peak * min_lr_ratio`.
"""

from __future__ import annotations

import math


def _warmup(step: int, warmup: int, peak: float) -> float | None:
    return peak * (step + 1) / warmup if step < warmup else None


def _cosine(progress: float, peak: float, floor: float) -> float:
    progress = min(max(progress, 0.0), 1.0)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def constant(step: int, sched, peak: float, total: int) -> float:
    return _warmup(step, sched.warmup_steps, peak) or peak


def cosine(step: int, sched, peak: float, total: int) -> float:
    """Linear warmup, then one half cosine from peak down to the floor at the last step."""
    if (lr := _warmup(step, sched.warmup_steps, peak)) is not None:
        return lr
    span = max(total - sched.warmup_steps, 1)
    return _cosine((step - sched.warmup_steps) / span, peak, peak * sched.min_lr_ratio)


def sgdr(step: int, sched, peak: float, total: int) -> float:
    """Cosine with warm restarts (Loshchilov & Hutter): cycles of cycle_steps, each cycle_mult
    times longer than the one before; the LR jumps back to peak at every restart."""
    if (lr := _warmup(step, sched.warmup_steps, peak)) is not None:
        return lr
    t, length = step - sched.warmup_steps, float(sched.cycle_steps or max(total, 1))
    while t >= length:
        t -= length
        length *= sched.cycle_mult
    return _cosine(t / length, peak, peak * sched.min_lr_ratio)


def wsd(step: int, sched, peak: float, total: int) -> float:
    """Warmup-stable-decay: hold the peak, then decay over the last decay_fraction of the run
    (linear or cosine), so a run can be extended from any checkpoint of the stable phase."""
    if (lr := _warmup(step, sched.warmup_steps, peak)) is not None:
        return lr
    decay_steps = max(round(total * sched.decay_fraction), 1)
    start = total - decay_steps
    if step < start:
        return peak
    progress = (step - start) / decay_steps
    floor = peak * sched.min_lr_ratio
    if sched.decay_shape == "cosine":
        return _cosine(progress, peak, floor)
    return peak + (floor - peak) * min(progress, 1.0)


SCHEDULES = {"constant": constant, "cosine": cosine, "sgdr": sgdr, "wsd": wsd}


def lr_at(step: int, sched, peak: float, total: int) -> float:
    """The learning rate for optimizer step `step` under the schedule `sched` names."""
    return SCHEDULES[sched.name](step, sched, peak, total)
