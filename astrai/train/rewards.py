"""The built-in reward functions for GRPO: plain callables `(prompts, completions, **fields) ->
list[float]` (loaded by dotted path and called by astrai/eval/scoring.py, which evaluation's
generation tasks share).

`prompts` and `completions` are lists of strings, one per completion (the prompt as the model
saw it, chat template included); `fields` holds every key of the prompt records (`answer`,
`prompt`, ...) as lists aligned with them. A TOML names a reward by its dotted path:
`"astrai.train.rewards.exact_match"` or `"mymodule.myreward"` (any importable module).
"""

from __future__ import annotations

import re

from astrai.eval.scoring import final_answer

EQUATION = re.compile(r"-?\d+\s*[-+*/x×]\s*-?\d+\s*=\s*-?\d+\s*\.?\s*$")


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
