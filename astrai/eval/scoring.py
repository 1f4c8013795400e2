"""How a completion is judged: reward functions, pass@k.

A reward function is `(prompts, completions, **record_fields) -> list[float]`, one number per
completion; GRPO trains on them and a generation task scores with them. `exact`, `regex` and
`numeric` are built from a task's settings; anything else is named by its dotted path
("astrai.train.rewards.exact_match", "mymodule.myreward") and loaded with `load_reward`.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable

from astrai.config import EvalTask

Reward = Callable[..., list[float]]

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class RewardError(ValueError):
    """A reward function raised, or did not return one finite number per completion."""


def load_reward(path: str, key: str = "reward") -> Reward:
    """The callable a dotted path names, e.g. "astrai.train.rewards.exact_match"; `key` is the
    setting that named it, for the error message."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{key}: {path!r} is not a dotted path (module.function)")
    try:
        fn = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{key}: cannot load {path!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"{key}: {path!r} is not callable")
    return fn


def record_fields(records: list[dict], per_record: int) -> dict[str, list]:
    """Every key of the records as a list aligned with the completions, `per_record` of them
    to a record (None where a record lacks the key); "prompts" and "completions" are a reward
    function's own arguments."""
    keys = dict.fromkeys(k for r in records for k in r if k not in ("prompts", "completions"))
    return {k: [r.get(k) for r in records for _ in range(per_record)] for k in keys}


def call_reward(name: str, fn: Reward, prompts, completions, fields) -> list[float]:
    """fn's rewards for the completions; RewardError names it when it raises or returns other
    than one finite number per completion."""
    try:
        values = [float(v) for v in fn(prompts, completions, **fields)]
    except Exception as exc:
        raise RewardError(f"reward function {name} raised {type(exc).__name__}: {exc}") from exc
    if len(values) != len(completions):
        raise RewardError(
            f"reward function {name} returned {len(values)} rewards for "
            f"{len(completions)} completions"
        )
    if not all(math.isfinite(v) for v in values):
        raise RewardError(f"reward function {name} returned a non-finite reward")
    return values


def final_answer(completion: str) -> str | None:
    """The first number after the completion's last "=" ("12 + 30 = 42" -> "42"); without an
    "=", the completion's last number; None when there is no number there."""
    if "=" in completion:
        found = NUMBER.search(completion.rsplit("=", 1)[1])
        return found.group() if found else None
    numbers = NUMBER.findall(completion)
    return numbers[-1] if numbers else None


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


def scorer_for(task: EvalTask) -> Reward:
    """The scoring function a task names; the reference is the record's `answer_key` field."""
    key = task.answer_key
    pattern = re.compile(task.pattern) if task.pattern else None

    def answers(fields: dict, n: int) -> list:
        if key not in fields:
            raise ValueError(f"the records have no {key!r} (answer_key)")
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
    return builtins.get(task.score) or load_reward(task.score, f"task {task.name!r} score")


def _last_number(text: str) -> str | None:
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimate of P(at least one of k samples is right) from n samples of which
    `correct` were right: 1 - C(n - c, k) / C(n, k) (Chen et al., 2021)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)
