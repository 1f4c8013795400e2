"""Rows for the speculation gate's tests: sequences whose moving acceptance is set by hand."""

from __future__ import annotations

from astrai.infer import speculate_step
from astrai.infer.sequence import Sequence


def rows_at_rate(spec: speculate_step.Speculator, n: int, rate: float) -> list[Sequence]:
    """n one-token sequences, each with a RowSpec of acceptance `rate` in spec."""
    seqs = [Sequence(str(i), [1], 1) for i in range(n)]
    for seq in seqs:
        spec.rows[seq.id] = speculate_step.RowSpec(rate=rate)
    return seqs
