"""What an engine state holds, counted: requests, pages, prefix-cache hits, totals."""

from __future__ import annotations

import msgspec

from astrai.infer.donation import check_live
from astrai.infer.pages import num_free_pages
from astrai.infer.radix import num_cached_pages, num_evictable_pages
from astrai.infer.state import EngineState


class EngineStats(msgspec.Struct, frozen=True):
    """An engine's counts at one moment (`engine_stats`, `Engine.stats`, `/stats`)."""

    running: int
    waiting: int
    pages_total: int
    pages_free: int
    pages_cached: int
    pages_used: int  # held by requests (not free, not evictable from the prefix cache)
    prefix_cache_hit_rate: float
    steps: int
    preemptions: int
    requests_finished: int
    requests_aborted: int
    requests_failed: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # speculative decoding (EngineConfig.speculative), cumulative: request rows verified with
    # at least one proposed token, tokens proposed to them, and of those the tokens kept
    spec_steps: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    # prompt lookup's proposals not verified (a row below its floor, a step that would not
    # pay), scored against the tokens the rows then wrote: what verifying them would have kept
    spec_watched: int = 0
    spec_watched_kept: int = 0
    tokens_per_s: float = 0.0  # measured by the Engine over the recent past; 0 without one
    uptime_s: float = 0.0  # since the Engine started; 0 without one


def engine_stats(state: EngineState) -> EngineStats:
    """Counts of the engine: requests, pages, prefix-cache hits, totals. No clock involved."""
    check_live(state, "engine_stats")
    s, t, total = state.sched, state.totals, state.engine_config.num_pages
    free = num_free_pages(s.pool)
    evictable = num_evictable_pages(s.cache, s.pool)
    return EngineStats(
        running=len(s.running),
        waiting=len(s.waiting),
        pages_total=total,
        pages_free=free,
        pages_cached=num_cached_pages(s.cache) if s.cache is not None else 0,
        pages_used=total - free - evictable,
        prefix_cache_hit_rate=s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        steps=t.steps,
        preemptions=s.preemptions,
        requests_finished=t.finished,
        requests_aborted=t.aborted,
        requests_failed=t.errors,
        prompt_tokens=s.prompt_tokens,
        cached_tokens=s.cached_tokens,
        completion_tokens=t.completion_tokens,
        spec_steps=t.spec_steps,
        spec_proposed=t.spec_proposed,
        spec_accepted=t.spec_accepted,
        spec_watched=state.spec.watched if state.spec is not None else 0,
        spec_watched_kept=state.spec.watched_kept if state.spec is not None else 0,
    )
