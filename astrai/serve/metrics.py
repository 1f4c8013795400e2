"""Server metrics as plain data, rendered in the Prometheus text format.

Counters and histograms are updated on the event loop only, so they need no lock. The engine's
own numbers (running, waiting, pages, prefix-cache hit rate, ...) are read from `engine.stats()`
when /metrics is scraped and written as gauges, one per numeric stat.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter

from msgspec import Struct, field

LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class Histogram(Struct):
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0


class Metrics(Struct):
    requests: Counter = field(default_factory=Counter)  # (route, status) -> count
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token: Histogram = field(default_factory=Histogram)
    inter_token_latency: Histogram = field(default_factory=Histogram)
    request_latency: Histogram = field(default_factory=Histogram)
    # HTTP requests whose engine streams are open: request id -> when it came (monotonic)
    open_requests: dict[str, float] = field(default_factory=dict)


def observe(hist: Histogram, value: float, times: int = 1) -> None:
    hist.counts[bisect.bisect_left(hist.buckets, value)] += times
    hist.total += value * times
    hist.count += times


def count_request(metrics: Metrics, route: str, status: int) -> None:
    metrics.requests[(route, status)] += 1


def count_usage(metrics: Metrics, prompt: int, cached: int, completion: int) -> None:
    metrics.prompt_tokens += prompt
    metrics.cached_tokens += cached
    metrics.completion_tokens += completion


def _number(value: float) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")
    return repr(value) if isinstance(value, float) else str(value)


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


def _histogram(name: str, help_text: str, hist: Histogram) -> list[str]:
    lines = _header(name, "histogram", help_text)
    running = 0
    for bound, n in zip((*hist.buckets, math.inf), hist.counts):
        running += n
        lines.append(f'{name}_bucket{{le="{_number(float(bound))}"}} {running}')
    lines += [f"{name}_sum {_number(hist.total)}", f"{name}_count {hist.count}"]
    return lines


def _engine_gauges(stats: dict) -> list[str]:
    lines = []
    for key, value in sorted(stats.items()):
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        name = "astrai_" + "".join(c if c.isalnum() else "_" for c in key)
        lines += _header(name, "gauge", f"Engine stat {key!r}.")
        lines.append(f"{name} {_number(value)}")
    return lines


# (counter name, engine stat, help): speculative decoding's cumulative counts, which the engine
# stats hold as plain numbers, as Prometheus counters, whose rate() a dashboard can take
SPECULATION_COUNTERS = (
    ("astrai_speculative_proposed_tokens_total", "spec_proposed", "Tokens proposed."),
    ("astrai_speculative_accepted_tokens_total", "spec_accepted", "Proposed tokens kept."),
    (
        "astrai_speculative_verification_steps_total",
        "spec_steps",
        "Requests' verifications of a proposal (one per request per engine step).",
    ),
    (
        "astrai_speculative_watched_tokens_total",
        "spec_watched",
        "Tokens prompt lookup proposed without verifying, scored against what was written.",
    ),
    (
        "astrai_speculative_watched_kept_tokens_total",
        "spec_watched_kept",
        "Watched proposed tokens that the requests then wrote.",
    ),
)


def speculation_summary(stats: dict) -> dict:
    """What the speculative counts mean: the share of proposed tokens kept, and the tokens a
    request gains per verification (its kept proposals plus the model's own token); 0 before
    any verification."""
    steps, proposed, accepted = (
        stats.get(k, 0) for k in ("spec_steps", "spec_proposed", "spec_accepted")
    )
    return {
        "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
        "spec_tokens_per_step": (steps + accepted) / steps if steps else 0.0,
    }


def render(metrics: Metrics, stats: dict) -> str:
    lines = _header("astrai_requests_total", "counter", "HTTP requests answered.")
    for (route, status), n in sorted(metrics.requests.items()):
        lines.append(f'astrai_requests_total{{route="{route}",status="{status}"}} {n}')
    for name, value, help_text in (
        ("astrai_prompt_tokens_total", metrics.prompt_tokens, "Prompt tokens processed."),
        ("astrai_cached_prompt_tokens_total", metrics.cached_tokens, "Prompt tokens from cache."),
        ("astrai_generation_tokens_total", metrics.completion_tokens, "Tokens generated."),
    ):
        lines += [*_header(name, "counter", help_text), f"{name} {value}"]
    for name, key, help_text in SPECULATION_COUNTERS:
        lines += [*_header(name, "counter", help_text), f"{name} {stats.get(key, 0)}"]
    lines += _histogram(
        "astrai_time_to_first_token_seconds",
        "Time from request to first generated token.",
        metrics.time_to_first_token,
    )
    lines += _histogram(
        "astrai_inter_token_latency_seconds",
        "Time between generated tokens of one request.",
        metrics.inter_token_latency,
    )
    lines += _histogram(
        "astrai_request_duration_seconds",
        "Time from request to its last token.",
        metrics.request_latency,
    )
    return "\n".join(lines + _engine_gauges(stats)) + "\n"
