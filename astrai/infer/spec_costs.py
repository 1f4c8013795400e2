"""What a verify forward costs beyond a plain decode step, measured as the engine runs.

The speculation gate (speculate_step.worth_verifying) verifies a step only when the tokens
the proposals are expected to add exceed rows x (verify_cost + k x draft_cost), verify_cost
being what a forward over 1 + k positions per row costs beyond a decode step, as a share of
the decode step. That share is a property of the machine, not a constant: measured on the
speculation bench's target (512 wide, 8 layers, 1k vocabulary, float32, ~90 tokens of
context, median of 15 alternating calls, a 2-core AMD EPYC shared with other work, load
average 9-12), a verify forward against a decode step was

    1 thread,  1 row:  k=1 1.09-1.35x, k=2 1.18-1.46x, k=4 1.19-1.48x
    1 thread, 16 rows: k=1 1.29-1.31x, k=2 1.58-1.67x, k=4 2.00-2.32x

so at 16 rows a verify of k=4 costs 1.0-1.3 decode steps beyond one, where the constant
0.3 + 0.1 k (measured once, one thread, one row) says 0.7; at two threads the share moves
again (the decode step of one row parallelises poorly, the wider forward well) and on a
loaded machine it moves with the load. So the engine times its own steps: each plain decode
step (per model step of a decode run) into a moving average of seconds per batch-size
bucket, and each verify step as a share of that bucket's decode time, a moving average per
(bucket, k) that starts at the constant and moves toward what the steps measure. The first
step of each shape is left out: it pays for allocating and choosing kernels.

A draft's step is timed the same way (per draft step, per bucket of the step's rows): its
share of a target step is what the weights each reads say only where both are bound by
reading weights (0.036 by the weights, 0.042-0.044 timed at one thread); a small draft's step
is mostly fixed per-op cost, which grows with threads and load (on the loaded machine at two
threads a target decode step took 1.2 s of waking threads), so the gate uses the measured
share once there is one.

Pure functions over a small frozen dataclass; the engine step keeps it on the Speculator.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# Each measurement moves an average by this share: one step slowed by another process on a
# shared machine moves the gate by a quarter of its error, and about ten steps of a new
# load replace the old figure.
COST_WEIGHT = 0.25


@dataclass(frozen=True)
class StepCosts:
    """Moving step costs: seconds of a plain decode model step per batch-size bucket, what a
    verify step costs beyond one as a share of it per (bucket, k), and the shapes already
    seen once (their first step is a warm-up, not a measurement)."""

    decode: dict[int, float] = field(default_factory=dict)
    verify: dict[tuple[int, int], float] = field(default_factory=dict)
    draft: dict[int, float] = field(default_factory=dict)  # seconds of a draft step
    seen: frozenset = frozenset()


def prior_verify_cost(k: int) -> float:
    """The cost beyond a decode step before any is measured: 0.3 + 0.1 k, measured on a
    2-core EPYC at one thread, one row (a 512-wide 8-layer model, 32k vocabulary, 200 tokens
    of context): k=1 1.1-2.0x, k=2 1.1-2.3x, k=4 1.6-1.85x a decode step."""
    return 0.3 + 0.1 * k


def size_bucket(rows: int) -> int:
    """The power of two at or above `rows`: steps of similar batches share a measurement."""
    if rows < 1:
        raise ValueError(f"rows: a step has at least one row, got {rows}")
    return 1 << (rows - 1).bit_length()


def _moved(old: float | None, sample: float) -> float:
    return sample if old is None else old + COST_WEIGHT * (sample - old)


def with_decode(costs: StepCosts, rows: int, seconds: float) -> StepCosts:
    """costs with one plain decode model step of `rows` rows that took `seconds`."""
    key = ("decode", size_bucket(rows))
    if key not in costs.seen:
        return replace(costs, seen=costs.seen | {key})
    bucket = key[1]
    return replace(
        costs, decode={**costs.decode, bucket: _moved(costs.decode.get(bucket), seconds)}
    )


def with_draft(costs: StepCosts, rows: int, seconds: float) -> StepCosts:
    """costs with one draft step in a step of `rows` rows that took `seconds`."""
    key = ("draft", size_bucket(rows))
    if key not in costs.seen:
        return replace(costs, seen=costs.seen | {key})
    bucket = key[1]
    return replace(costs, draft={**costs.draft, bucket: _moved(costs.draft.get(bucket), seconds)})


def with_verify(costs: StepCosts, rows: int, k: int, seconds: float) -> StepCosts:
    """costs with one verify step of `rows` rows and 1 + k positions that took `seconds`;
    it counts once the bucket's decode step is measured (its share is what the gate uses)."""
    bucket = size_bucket(rows)
    key = ("verify", bucket, k)
    if key not in costs.seen:
        return replace(costs, seen=costs.seen | {key})
    decode = costs.decode.get(bucket)
    if decode is None or decode <= 0:
        return costs
    share = max(0.0, seconds / decode - 1.0)
    old = costs.verify.get((bucket, k), prior_verify_cost(k))
    return replace(costs, verify={**costs.verify, (bucket, k): _moved(old, share)})


def verify_cost(costs: StepCosts, rows: int, k: int) -> float:
    """What a verify step of `rows` rows over 1 + k positions costs beyond a plain decode
    step, as a share of the decode step: measured where the engine has measured it, else
    the prior."""
    if k <= 0:
        return 0.0
    return costs.verify.get((size_bucket(rows), k), prior_verify_cost(k))


def draft_cost(costs: StepCosts, rows: int, prior: float) -> float:
    """A draft step as a share of a target decode step in a step of `rows` rows: measured
    where both are, else `prior` (the share of the weights each reads)."""
    bucket = size_bucket(rows)
    decode, draft = costs.decode.get(bucket), costs.draft.get(bucket)
    if decode is None or draft is None or decode <= 0:
        return prior
    return draft / decode
