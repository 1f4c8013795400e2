"""How a generation task decides that a completion is right, and pass@k.

A scorer is a reward function as GRPO takes them, `(prompts, completions, **record_fields)
-> list[float]`; `exact`, `regex` and `numeric` are built from the task's settings, anything
else is a dotted path (astrai/train/rewards.py's convention).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from astrai.config import EvalTask
from astrai.train.rewards import NUMBER, final_answer, load_reward

Scorer = Callable[..., list[float]]


def same_number(found: str | None, reference) -> bool:
    try:
        return found is not None and float(found) == float(str(reference).replace(",", ""))
    except ValueError:
        return False


def extract(pattern: re.Pattern, completion: str) -> str | None:
    """The first group of the pattern's first match (the whole match without groups)."""
    found = pattern.search(completion)
    if found is None:
        return None
    return found.group(1) if pattern.groups else found.group(0)


def scorer_for(task: EvalTask) -> Scorer:
    """The scoring function a task names; the reference is the record's `answer_key` field."""
    key = task.answer_key
    pattern = re.compile(task.pattern) if task.pattern else None

    def answers(fields: dict, n: int) -> list:
        if key not in fields:
            raise ValueError(f"task {task.name!r}: the records have no {key!r} (answer_key)")
        return fields[key]

    def exact(prompts, completions, **fields):
        refs = answers(fields, len(completions))
        return [float(c.strip() == str(r).strip()) for c, r in zip(completions, refs)]

    def regex(prompts, completions, **fields):
        refs = answers(fields, len(completions))
        found = [extract(pattern, c) for c in completions]
        return [float(f is not None and f.strip() == str(r).strip()) for f, r in zip(found, refs)]

    def numeric(prompts, completions, **fields):
        refs = answers(fields, len(completions))
        found = [
            extract(pattern, c) if pattern else final_answer(c) or _last_number(c)
            for c in completions
        ]
        return [float(same_number(f, r)) for f, r in zip(found, refs)]

    builtins = {"exact": exact, "regex": regex, "numeric": numeric}
    return builtins.get(task.score) or load_reward(task.score)


def _last_number(text: str) -> str | None:
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimate of P(at least one of k samples is right) from n samples of which
    `correct` were right: 1 - C(n - c, k) / C(n, k) (Chen et al., 2021)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)
