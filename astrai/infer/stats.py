"""What an engine state holds, counted: requests, pages, prefix-cache hits, totals."""

from __future__ import annotations

from astrai.infer.donation import check_live
from astrai.infer.pages import num_free_pages
from astrai.infer.radix import num_cached_pages, num_evictable_pages
from astrai.infer.state import EngineState


def engine_stats(state: EngineState) -> dict:
    """Counts of the engine: requests, pages, prefix-cache hits, totals. No clock involved."""
    check_live(state, "engine_stats")
    s, t, total = state.sched, state.totals, state.engine_config.num_pages
    free = num_free_pages(s.pool)
    cached = num_cached_pages(s.cache) if s.cache is not None else 0
    evictable = num_evictable_pages(s.cache, s.pool)
    return {
        "running": len(s.running),
        "waiting": len(s.waiting),
        "pages_total": total,
        "pages_free": free,
        "pages_cached": cached,
        "pages_used": total - free - evictable,  # held by requests
        "prefix_cache_hit_rate": s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0,
        "steps": t.steps,
        "preemptions": s.preemptions,
        "requests_finished": t.finished,
        "requests_aborted": t.aborted,
        "requests_failed": t.errors,
        "prompt_tokens": s.prompt_tokens,
        "cached_tokens": s.cached_tokens,
        "completion_tokens": t.completion_tokens,
    }
