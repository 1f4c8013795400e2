"""One run's outcomes -> the figures serving benchmarks report: throughput, TTFT, TPOT,
hand-over gap and end-to-end percentiles, goodput under a latency objective, and the
accounting (lost, duplicated or short requests)."""

from __future__ import annotations

from dataclasses import dataclass

from benchmark.timing import percentile as timed_percentile

from .client import Outcome
from .stream import handover_gaps, time_per_output_token
from .workloads import Job

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Objective:
    """A request is good when its first token came within ttft_ms and its tokens after that
    came on average within tpot_ms each (vLLM's TTFT and TPOT objectives)."""

    ttft_ms: float
    tpot_ms: float


def percentile(values: list[float], q: float) -> float:
    """The benchmark's percentile (linear interpolation); NaN for no values."""
    return timed_percentile(values, q) if values else float("nan")


def accounting(jobs: list[Job], outcomes: list[Outcome]) -> dict:
    """Requests failed, or answered with another token count than asked (lost or extra)."""
    failed = [o.index for o in outcomes if o.error is not None]
    wrong = [
        o.index
        for o, job in zip(outcomes, jobs)
        if o.error is None and not (o.completion_tokens == len(o.chunk_s) == job.output_len)
    ]
    return {"requests": len(jobs), "failed": failed, "wrong_token_count": wrong}


def summarize(jobs: list[Job], outcomes: list[Outcome], wall_s: float, slo: Objective) -> dict:
    """Per-run figures in seconds-free units: tok/s, req/s, milliseconds."""
    ok = [o for o in outcomes if o.error is None and o.chunk_s]
    arrival = {job.index: job.arrival_s for job in jobs}
    ttft = [(o.chunk_s[0] - o.sent_s) * 1000 for o in ok]
    e2e = [(o.chunk_s[-1] - o.sent_s) * 1000 for o in ok]
    per_token = [time_per_output_token(o.chunk_s) for o in ok]  # None for a one-token request
    handover = [gap * 1000 for o in ok for gap in handover_gaps(o.chunk_s)]
    good = sum(
        first <= slo.ttft_ms and (tpot or 0.0) * 1000 <= slo.tpot_ms
        for first, tpot in zip(ttft, per_token)
    )
    # late sends (the client fell behind its schedule) would flatter the latencies: report them
    lag = [o.sent_s - arrival[o.index] for o in outcomes]
    figures = {
        "wall_s": wall_s,
        "completed": len(ok),
        "output_tok_s": sum(len(o.chunk_s) for o in ok) / wall_s,
        "requests_s": len(ok) / wall_s,
        "goodput_requests_s": good / wall_s,
        "good_fraction": good / len(jobs),
        "send_lag_max_ms": max(lag) * 1000 if lag else 0.0,
    }
    tpot = [t * 1000 for t in per_token if t is not None]
    for name, values in (("ttft", ttft), ("tpot", tpot), ("handover", handover), ("e2e", e2e)):
        for q in QUANTILES:
            figures[f"{name}_p{q}_ms"] = percentile(values, q)
    return figures
