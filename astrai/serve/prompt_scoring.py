"""Scoring a prompt through text completions, as lm-evaluation-harness does with `echo` and
`logprobs`: each prompt token's log-probability given the tokens before it, from `forward` on
the served weights; `max_tokens` 0 scores the prompt and generates nothing."""

from __future__ import annotations

import anyio

from astrai.eval.loglik import score_pairs
from astrai.infer import Completion, Logprob
from astrai.infer.events import Usage as EngineUsage
from astrai.serve.errors import bad_request
from astrai.serve.schemas_openai import CompletionRequest
from astrai.serve.state import AppState, prompt_too_long


def check_scoring(
    req: CompletionRequest, prompts: list[list[int]], context: int, adapter: str | None
) -> None:
    """What scoring a prompt needs: max_tokens 0 only with echo, echoed log-probs not streamed,
    the prompt within the context, the base model (the scores come from its weights alone)."""
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens is 0, which generates nothing; it needs echo.", "max_tokens")
    scoring = req.max_tokens == 0 or (req.echo and req.logprobs is not None)
    if scoring and req.stream:
        raise bad_request(
            "echo with logprobs (or max_tokens 0) is answered whole: set stream to false.",
            "stream",
        )
    if scoring and adapter is not None:
        raise bad_request(
            f"echo with logprobs (or max_tokens 0) scores the prompt with the base model only, "
            f"not with adapter `{adapter}`: ask the base model, or leave out echo.",
            "model",
        )
    for ids in prompts:
        if req.max_tokens == 0 and len(ids) > context:
            raise prompt_too_long(len(ids), context, "prompt")


def prompt_entries(engine, prompts: list[list[int]], top: int, context: int) -> list[list[Logprob]]:
    """Each prompt's tokens as Logprob entries; the first token
    has None for both, having no context. One prompt per forward pass: a [T, vocab] block of
    logits at most."""
    pairs = [(ids[:1], ids[1:]) for ids in prompts if len(ids) > 1]
    # on the engine's thread, with its weights: one compute thread in the server process
    scored = iter(
        engine.call(lambda params: score_pairs(params, engine.cfg, pairs, 1, context, top=top))
    )
    entries = []
    for ids in prompts:
        first = [Logprob(ids[0], None)] if ids else []
        s = next(scored) if len(ids) > 1 else None
        rest = [] if s is None else [
            Logprob(t, lp, best)
            for t, lp, best in zip(ids[1:], s.logprobs, s.top or [[]] * len(s.logprobs))
        ]  # fmt: skip
        entries.append(first + rest)
    return entries


async def echoed_entries(
    state: AppState, req: CompletionRequest, prompts: list[list[int]]
) -> list[list[Logprob]]:
    """Per choice, the log-prob entries of its echoed prompt: scored once per prompt, shared by
    its n choices; none unless the request echoes with logprobs."""
    if not (req.echo and req.logprobs is not None):
        return [[] for _ in prompts for _ in range(req.n)]
    scored = await anyio.to_thread.run_sync(
        prompt_entries, state.engine, prompts, req.logprobs, state.context
    )
    return [entries for entries in scored for _ in range(req.n)]


def prompt_only(prompt: list[int]) -> Completion:
    """The outcome of `max_tokens` 0: the prompt, and nothing generated."""
    return Completion(finish_reason="length", usage=EngineUsage(len(prompt), 0, 0))
