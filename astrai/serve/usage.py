"""The token counts of one HTTP request's choices, in each API's form."""

from __future__ import annotations

from astrai.infer.events import Usage as EngineUsage
from astrai.serve import schemas_anthropic, schemas_openai


def total_usage(usages: list[EngineUsage | None], per_prompt: int) -> EngineUsage:
    """Usage of all choices: each prompt counts once (its `per_prompt` choices share it),
    completions add up. A choice without usage (it failed) counts nothing."""
    firsts = [u for u in usages[::per_prompt] if u is not None]
    return EngineUsage(
        prompt_tokens=sum(u.prompt_tokens for u in firsts),
        cached_tokens=sum(u.cached_tokens for u in firsts),
        completion_tokens=sum(u.completion_tokens for u in usages if u is not None),
    )


def openai_usage(usages: list[EngineUsage | None], per_prompt: int) -> schemas_openai.Usage:
    u = total_usage(usages, per_prompt)
    total = u.prompt_tokens + u.completion_tokens
    details = {"cached_tokens": u.cached_tokens}
    return schemas_openai.Usage(u.prompt_tokens, u.completion_tokens, total, details)


def anthropic_usage(usage: EngineUsage | None, n_prompt: int) -> schemas_anthropic.Usage:
    """As in Anthropic's API, input_tokens leaves out the prompt tokens read from the cache.
    Without usage (the request failed) the prompt is all that is known."""
    if usage is None:
        return schemas_anthropic.Usage(n_prompt, 0)
    cached = usage.cached_tokens
    return schemas_anthropic.Usage(usage.prompt_tokens - cached, usage.completion_tokens, cached)
