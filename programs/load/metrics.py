"""One run's outcomes -> the figures serving benchmarks report: throughput, TTFT, ITL and
end-to-end percentiles, goodput under a latency objective, and the accounting (lost,
duplicated or short requests)."""

from __future__ import annotations

from dataclasses import dataclass

from benchmark.timing import percentile as timed_percentile

from .client import Outcome
from .workloads import Job

QUANTILES = (50, 90, 99)


@dataclass(frozen=True)
class Objective:
    """A request is good when its first token came within ttft_ms and its tokens after that
    came on average within itl_ms each (vLLM's TTFT and TPOT objectives)."""

    ttft_ms: float
    itl_ms: float


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
    itl = [(b - a) * 1000 for o in ok for a, b in zip(o.chunk_s, o.chunk_s[1:])]
    tpot = [
        (o.chunk_s[-1] - o.chunk_s[0]) * 1000 / (len(o.chunk_s) - 1)
        for o in ok
        if len(o.chunk_s) > 1
    ]
    good = sum(
        (o.chunk_s[0] - o.sent_s) * 1000 <= slo.ttft_ms
        and (
            len(o.chunk_s) < 2
            or (o.chunk_s[-1] - o.chunk_s[0]) * 1000 / (len(o.chunk_s) - 1) <= slo.itl_ms
        )
        for o in ok
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
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e), ("tpot", tpot)):
        for q in QUANTILES:
            figures[f"{name}_p{q}_ms"] = percentile(values, q)
    return figures
