"""Seeded workloads: what each request sends (token ids), asks for (exact output length,
`ignore_eos`) and when it arrives.

mixed: prompt and output lengths log-normal, like chat traffic (most turns short, a long
tail of pasted documents and long answers). Prompts: median 128 tokens, sigma 1.0, clipped to
16-1024; outputs: median 96, sigma 0.9, clipped to 16-512 (ShareGPT-style conversations have
about this shape: medians in the low hundreds, a tail an order of magnitude longer).

shared: a 1,000-token system prompt shared by every request plus a distinct 16-64 token
question, 32 output tokens: an assistant behind one long instruction.

grounded: a document (log-normal length, median a quarter of the clip) and a short request
to quote, summarise or edit it that repeats a span of it; the output (half the document's
length, at most the output clip) is meant to copy from the prompt, as summaries, quotes and
code edits do, which is where prompt lookup (`--speculative lookup`) pays. On a model that
was not trained to copy, the lookup's proposals are rarely kept: what is measured then is the
cost of proposing.

Arrivals: a Poisson process at `rate` requests/s (exponential gaps), or all at time 0 when
the rate is infinite. The same seed gives the same requests and arrival times.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORKLOADS = ("mixed", "shared", "grounded")


@dataclass(frozen=True)
class Shape:
    """A workload's size; `scaled` shrinks the lengths for a small machine."""

    requests: int
    prompt_max: int  # mixed: the clip of prompt lengths; shared: the system prompt's length
    output_max: int


DEFAULT_SHAPES = {
    "mixed": Shape(256, 1024, 512),
    "shared": Shape(64, 1000, 32),
    "grounded": Shape(64, 1024, 256),
}


@dataclass(frozen=True)
class Job:
    """One request of a workload."""

    index: int
    prompt: list[int]
    output_len: int
    arrival_s: float  # after the run's start


def lognormal_lengths(
    rng: random.Random, n: int, median: float, sigma: float, low: int, high: int
) -> list[int]:
    return [
        min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)
    ]


def arrivals(rng: random.Random, n: int, rate: float) -> list[float]:
    """Poisson arrival times (exponential gaps of mean 1/rate); all 0 for rate = inf."""
    if math.isinf(rate):
        return [0.0] * n
    times, now = [], 0.0
    for _ in range(n):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def _tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _grounded_prompt(rng: random.Random, doc_len: int, vocab: int) -> list[int]:
    """A document, then a request (8-16 tokens of its own) ending in the span of the document
    the answer starts from."""
    doc = _tokens(rng, doc_len, vocab)
    start = rng.randrange(doc_len // 2)
    return doc + _tokens(rng, rng.randint(8, 16), vocab) + doc[start : start + 8]


def make_workload(name: str, shape: Shape, vocab: int, rate: float, seed: int = 0) -> list[Job]:
    """The jobs of workload `name`. Lengths and prompts depend on the seed only; arrival
    times on the seed and the rate, so every rate serves the very same requests."""
    rng = random.Random(seed)
    n = shape.requests
    if name == "mixed":
        scale = shape.prompt_max / 1024  # a smaller clip keeps the shape: medians scale too
        prompt_lens = lognormal_lengths(rng, n, 128 * scale, 1.0, 16, shape.prompt_max)
        out_scale = shape.output_max / 512
        output_lens = lognormal_lengths(rng, n, 96 * out_scale, 0.9, 16, shape.output_max)
        prompts = [_tokens(rng, k, vocab) for k in prompt_lens]
    elif name == "shared":
        system = _tokens(rng, shape.prompt_max, vocab)
        prompts = [system + _tokens(rng, rng.randint(16, 64), vocab) for _ in range(n)]
        output_lens = [shape.output_max] * n
    elif name == "grounded":
        doc_lens = lognormal_lengths(rng, n, shape.prompt_max / 4, 0.6, 32, shape.prompt_max)
        prompts = [_grounded_prompt(rng, k, vocab) for k in doc_lens]
        output_lens = [max(16, min(shape.output_max, k // 2)) for k in doc_lens]
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    times = arrivals(random.Random(f"{seed}-{rate}"), n, rate)
    return [Job(i, p, k, t) for i, (p, k, t) in enumerate(zip(prompts, output_lens, times))]
