"""Reward functions for GRPO: plain callables `(prompts, completions, **fields) -> list[float]`.

`prompts` and `completions` are lists of strings, one per completion (the prompt as the model
saw it, chat template included); `fields` holds every key of the prompt records (`answer`,
`prompt`, ...) as lists aligned with them. A TOML names a reward by its dotted path:
`"astrai.train.rewards.exact_match"` or `"mymodule.myreward"` (any importable module).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable

Reward = Callable[..., list[float]]

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
EQUATION = re.compile(r"-?\d+\s*[-+*/x×]\s*-?\d+\s*=\s*-?\d+\s*\.?\s*$")


def final_answer(completion: str) -> str | None:
    """The first number after the completion's last "=" ("12 + 30 = 42" -> "42"); without an
    "=", the completion's last number; None when there is no number there."""
    if "=" in completion:
        found = NUMBER.search(completion.rsplit("=", 1)[1])
        return found.group() if found else None
    numbers = NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def same_answer(found: str | None, reference) -> bool:
    """Numbers compare by value ("42.0" == "42"), anything else as stripped text."""
    if found is None or reference is None:
        return False
    try:
        return float(found) == float(reference)
    except ValueError:
        return found.strip() == str(reference).strip()


def exact_match(prompts: list[str], completions: list[str], answer=None, **_) -> list[float]:
    """1.0 where the completion's final answer equals the record's reference `answer`."""
    answers = answer if answer is not None else [None] * len(completions)
    return [float(same_answer(final_answer(c), a)) for c, a in zip(completions, answers)]


def equation_format(prompts: list[str], completions: list[str], **_) -> list[float]:
    """1.0 where the completion ends in one equation of the shape "a op b = c" (the demo's
    answers end so, after their worked steps), whatever its numbers."""
    return [float(EQUATION.search(c) is not None) for c in completions]


def load_reward(path: str) -> Reward:
    """The callable a dotted path names, e.g. "astrai.train.rewards.exact_match"."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"grpo.rewards: {path!r} is not a dotted path (module.function)")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"grpo.rewards: cannot load {path!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"grpo.rewards: {path!r} is not callable")
    return fn
