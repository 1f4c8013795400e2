"""Whether the two sides of a comparison did the same work and computed the same model.

A ratio of two speeds says something only when both sides did the same work: as many tokens
for every request, after the same prompts. A row whose sides did not is refused (no ratio).

It also says little when one side is fast because it computes something else, and greedy
decoding makes that checkable. Two correct sides choose the same tokens unless rounding parts
them where the model's best two tokens nearly tie. So where two sides part, each side's every
choice is held against the exact model: our forward in float64 on the same weights, fed the
side's own tokens. A side chose its token because its own logit for it was the highest; when
every logit it computed is off the exact one by at most e, the token's exact logit is at most
2e below the exact best. e is measured at those very tokens: how far our forward in the side's
precision (the run's dtype, and 8-bit weights for our side with --quantize) lands from float64,
the largest deviation over the vocabulary. Another kernel or order of operations in the same
precision (the side's own incremental decoding, transformers' kernels) may round up to about
twice as much, so a choice is explained by rounding when it falls short of the exact best by
at most 4e. One that falls short by more makes the row not comparable.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

ROUNDING_EXPLAINS = 4  # e per choice: 2 for the two logits compared, 2 for another kernel
CHECKED_REQUESTS = 4  # where sides part: the requests that part earliest, at most this many


class Choices(NamedTuple):
    """One side's greedy choices for one request given `prompt`: generated tokens (fed_back:
    each is the next input), or a forward's next-token predictions at the prompt's last
    len(chosen) positions."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    fed_back: bool

    def feed(self) -> tuple[int, ...]:
        """The tokens whose logits made the choices (a last generated token feeds nothing)."""
        return self.prompt + self.chosen[:-1] if self.fed_back else self.prompt

    def positions(self) -> range:
        """The positions of feed() whose logits made each choice."""
        start = len(self.prompt) - (1 if self.fed_back else len(self.chosen))
        return range(start, start + len(self.chosen))


def generated(prompt: list[int], completion: list[int]) -> Choices:
    return Choices(tuple(prompt), tuple(completion), True)


def predicted(tokens: list[int], chosen: list[int]) -> Choices:
    return Choices(tuple(tokens), tuple(chosen), False)


def leading(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading choices two sides share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(a: list[Choices], b: list[Choices]) -> float:
    """The share of choices two sides agree on, averaged over requests: of generated tokens the
    leading ones only (after the first difference the sides decode different texts), of a
    forward's predictions every position."""

    def share(x: Choices, y: Choices) -> float:
        if x.fed_back:
            return leading(x.chosen, y.chosen) / max(len(x.chosen), 1)
        return sum(p == q for p, q in zip(x.chosen, y.chosen)) / max(len(x.chosen), 1)

    return sum(map(share, a, b)) / max(len(a), 1)


def work_mismatch(names: tuple[str, str], a: list[Choices], b: list[Choices]) -> str | None:
    """Why two sides' choices are not the same work (another number of requests, another
    prompt, another number of choices), or None."""
    first, second = names
    if len(a) != len(b):
        return f"{first} answered {len(a)} requests, {second} {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.prompt != y.prompt:
            return f"request {i}: {first} and {second} were given different prompts"
        if len(x.chosen) != len(y.chosen):
            return f"request {i}: {first} chose {len(x.chosen)} tokens, {second} {len(y.chosen)}"
    return None


def same_work(names: tuple[str, str], a: list[Choices], b: list[Choices]) -> dict:
    """The fields of a row whose sides are meant to choose differently (a grammar on one):
    refused for different work, else comparable, with no agreement to show."""
    mismatch = work_mismatch(names, a, b)
    if mismatch is not None:
        return {"agreement": None, "verdict": "refused", "why": f"different work: {mismatch}"}
    return {"agreement": None, "verdict": "comparable", "why": None}


def parting(a: list[Choices], b: list[Choices], limit: int = CHECKED_REQUESTS) -> list[int]:
    """The requests whose choices differ between the sides, those that part earliest (as a
    share of their length) first, at most limit."""
    differ = [i for i, (x, y) in enumerate(zip(a, b)) if x.chosen != y.chosen]
    order = sorted(differ, key=lambda i: leading(a[i].chosen, b[i].chosen) / len(a[i].chosen))
    return order[:limit]


def shortfalls(exact: torch.Tensor, rounded: torch.Tensor, chosen: torch.Tensor):
    """Per choice (logits [choices, vocab]): how far the chosen token's exact logit is below
    the exact best, and how far rounding explains (ROUNDING_EXPLAINS x the largest deviation
    of the rounded logits from the exact ones)."""
    exact, rounded = exact.double(), rounded.double()
    short = exact.amax(-1) - exact.gather(-1, chosen[:, None])[:, 0]
    explained = ROUNDING_EXPLAINS * (rounded - exact).abs().amax(-1)
    return short, explained


Logits = Callable[[tuple[int, ...]], torch.Tensor]  # feed -> logits [len(feed), vocab]


def forward_logits(params: dict, cfg) -> Logits:
    """feed -> our forward's logits [len(feed), vocab] for params, on the CPU in float64,
    remembered for the last few feeds (sides that choose alike feed alike)."""
    import astrai

    device = next(iter(params.values())).device

    @functools.lru_cache(maxsize=2)
    @torch.inference_mode()
    def logits(feed: tuple[int, ...]) -> torch.Tensor:
        return astrai.forward(params, cfg, torch.tensor([feed], device=device))[0].double().cpu()

    return logits


def unexplained(choices: Choices, exact: Logits, rounded: Logits) -> str | None:
    """The first choice that falls short of the exact model's best by more than rounding
    explains, in words, or None."""
    feed, positions = choices.feed(), list(choices.positions())
    short, explained = shortfalls(
        exact(feed)[positions], rounded(feed)[positions], torch.tensor(choices.chosen)
    )
    bad = (short > explained).nonzero()
    if len(bad) == 0:
        return None
    k = int(bad[0])
    return (
        f"choice {k} (token {choices.chosen[k]}) is {short[k]:.3g} below the exact model's "
        f"best logit, where rounding explains {explained[k]:.3g}"
    )


def verdict(
    names: tuple[str, str],
    choices: tuple[list[Choices], list[Choices]],
    exact: Logits,
    rounded: tuple[Logits | None, Logits | None],
) -> dict:
    """The fields a comparison row gets: "agreement" (agreement's share, None when refused),
    "verdict" ("comparable", "not comparable", "refused", or "unchecked" where the sides part
    and a side's rounding cannot be measured) and "why" (None when comparable)."""
    a, b = choices
    work = same_work(names, a, b)
    if work["verdict"] == "refused":
        return work
    share = agreement(a, b)
    unchecked = []
    for i in parting(a, b):
        for name, side, rounds in zip(names, (a[i], b[i]), rounded):
            if rounds is None:
                unchecked.append(name)
                continue
            problem = unexplained(side, exact, rounds)
            if problem is not None:
                why = f"{name}, request {i}: {problem}"
                return {"agreement": share, "verdict": "not comparable", "why": why}
    if unchecked:
        why = f"the sides part; {unchecked[0]}'s rounding cannot be measured"
        return {"agreement": share, "verdict": "unchecked", "why": why}
    return {"agreement": share, "verdict": "comparable", "why": None}
