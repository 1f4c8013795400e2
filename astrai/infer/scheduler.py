"""Continuous batching as plain Python state: which sequences run, which wait, who gets pages.

Every step, `plan_step` admits waiting sequences, gives each running sequence the pages its
next tokens need and decides what the step computes: one token for each decoding sequence and
prompt chunks, within a token budget, for the sequences still prefilling. Long prompts thus
advance a chunk per step while running streams keep decoding. When pages run out, cached pages
nobody uses are evicted first, then the newest running sequence is preempted: its pages are
freed and it waits again at the front of the queue, to be recomputed from its tokens later.

For a window-only model (every layer slides over `window` positions) the pages wholly behind
the window are given back as the sequence advances, so it holds about the window's pages
however long it grows. Its prompt is offered to the prefix cache before any page goes back; a
released page the cache also holds stays cached (giving back only drops the sequence's
reference), and a sequence with released pages never offers its chain again.

The scheduler state holds the page pool and the prefix cache. Every function that changes it
takes it and returns it, donated: it is updated in place, and the caller goes on with what
comes back. The sequences it holds are part of it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from astrai.config import EngineConfig
from astrai.infer.pages import (
    Pool,
    alloc_pages,
    free_pages,
    num_free_pages,
    pages_for,
    share_pages,
)
from astrai.infer.radix import (
    PrefixCache,
    clear_prefix_cache,
    drop_prefix_key,
    evict,
    init_prefix_cache,
    insert_prefix,
    match_prefix,
    num_evictable_pages,
)
from astrai.infer.sequence import RELEASED, Sequence


@dataclass(eq=False)
class Scheduler:
    pool: Pool
    cache: PrefixCache | None
    config: EngineConfig  # page_size, max_batch, the prefill budgets, chunked_prefill
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)  # in arrival order
    arrivals: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    window: int | None = None  # every query looks this many positions back at most; None: all


@dataclass
class StepPlan:
    decode: list[Sequence]  # feed one token each
    prefill: list[tuple[Sequence, int]]  # feed this many tokens each
    preempted: list[Sequence]


def init_scheduler(pool: Pool, config: EngineConfig, window: int | None = None) -> Scheduler:
    """An empty scheduler over `pool`, whose pages hold `config.page_size` tokens each. With a
    `window` (ModelConfig.attention_window) pages behind it are given back."""
    cache = init_prefix_cache(config.page_size) if config.prefix_cache else None
    return Scheduler(pool, cache, config, window=window)


def add_sequence(s: Scheduler, seq: Sequence) -> Scheduler:
    """seq waits for its turn at the end of the queue."""
    s.waiting.append(seq)
    return s


def available_pages(s: Scheduler) -> int:
    """Free pages plus cached pages no sequence holds (they can be evicted)."""
    return num_free_pages(s.pool) + num_evictable_pages(s.cache, s.pool)


def _same_prefix_in_prefill(s: Scheduler, seq: Sequence, matched: int) -> bool:
    """Whether a running sequence is still prefilling the next full page of seq's prompt.
    Once it finishes, its prompt is cached and seq reuses those pages instead of computing
    the same K/V again (n choices of one prompt, a shared system prompt)."""
    end = (matched + 1) * s.config.page_size
    if s.cache is None or end > len(seq.tokens) - 1:
        return False
    head = seq.tokens[:end]
    return any(
        other.computed < other.prompt_len
        and other.prefix_key == seq.prefix_key
        and other.tokens[:end] == head
        for other in s.running
    )


def _admit(s: Scheduler) -> Scheduler:
    promised = 0  # pages the prompts admitted in this call will take as they are prefilled
    for seq in list(s.waiting):
        if len(s.running) >= s.config.max_batch:
            break
        # never the whole sequence: the last token must be fed to get the next logits
        cached = []
        if s.cache is not None:
            s.cache, cached = match_prefix(s.cache, seq.tokens[:-1], seq.prefix_key)
        if _same_prefix_in_prefill(s, seq, len(cached)):
            continue
        needed = pages_for(len(seq.tokens), s.config.page_size) - len(cached)
        if _releases_while_prefilling(s, seq):  # it never holds more than a window and a chunk
            ps = s.config.page_size
            needed = min(
                needed, pages_for(s.window, ps) + 1 + pages_for(s.config.prefill_chunk, ps)
            )
        if s.running and needed > available_pages(s) - promised:
            break  # wait for pages rather than thrash; the oldest is always let in
        promised += needed
        s.waiting.remove(seq)
        s.pool = share_pages(s.pool, cached)
        seq.pages, seq.computed = list(cached), len(cached) * s.config.page_size
        if seq.cached_tokens < 0:
            seq.cached_tokens = seq.computed
            s.prompt_tokens += seq.prompt_len
            s.cached_tokens += seq.computed
        if not seq.arrival:
            s.arrivals += 1
            seq.arrival = s.arrivals
        s.running.append(seq)
        s.running.sort(key=lambda q: q.arrival)
    return s


def _held(seq: Sequence) -> list[int]:
    """The pages seq still holds: its pages less those given back."""
    return seq.pages[seq.released :]


def _releases_while_prefilling(s: Scheduler, seq: Sequence) -> bool:
    """Whether seq gives pages back before its prompt is done: for a window-only model with
    chunked prefill, when its prompt is not to be cached (no prefix cache, or a sequence whose
    K/V is never cached)."""
    uncached = s.cache is None or not seq.cacheable
    return s.window is not None and s.config.chunked_prefill and uncached


def preempt(s: Scheduler, seq: Sequence) -> Scheduler:
    """Give up a running sequence's pages; it waits at the front to be recomputed."""
    s.running.remove(seq)
    s.pool = free_pages(s.pool, _held(seq))
    seq.pages, seq.computed, seq.released = [], 0, 0
    seq.preemptions += 1
    s.preemptions += 1
    s.waiting.appendleft(seq)
    return s


def _reserve(s: Scheduler, seq: Sequence, end: int, preempted: list[Sequence]) -> Scheduler:
    """Make seq's pages cover tokens [0, end), evicting and preempting newer sequences as
    needed (each preempted one is added to `preempted`, seq itself possibly among them)."""
    need = pages_for(end, s.config.page_size) - len(seq.pages)
    while need > 0:
        s.pool, pages = alloc_pages(s.pool, need)
        if pages is not None:
            seq.pages += pages
            return s
        if s.cache is not None:
            s.cache, s.pool, freed = evict(s.cache, s.pool, need - num_free_pages(s.pool))
            if freed:
                continue
        victim = s.running[-1]
        s = preempt(s, victim)
        preempted.append(victim)
        if victim is seq:
            return s
    return s


def _whole_prompts(
    s: Scheduler, preempted: list[Sequence]
) -> tuple[Scheduler, list[tuple[Sequence, int]]]:
    """Without chunked prefill: the step prefills whole prompts, in arrival order, as many as
    fit the token budget once padded to the longest (always at least one) and the pages free
    now; it decodes nothing. When no prompt fits the pages, the step decodes instead."""
    prefill: list[tuple[Sequence, int]] = []
    width = 0
    for seq in [seq for seq in s.running if seq.pending > 1]:
        width = max(width, seq.pending)
        if prefill and (len(prefill) + 1) * width > s.config.prefill_chunk:
            break
        # a whole prompt takes only pages nobody holds: preempting for it would be undone
        # by the next admission, and the paused streams would never decode again
        if pages_for(len(seq.tokens), s.config.page_size) - len(seq.pages) > available_pages(s):
            break
        s = _reserve(s, seq, seq.computed + seq.pending, preempted)
        prefill.append((seq, seq.pending))
    return s, prefill


def plan_step(s: Scheduler) -> tuple[Scheduler, StepPlan]:
    """Decide this step's work and reserve its pages (see the module docstring). Returns
    (scheduler, plan); the scheduler is donated."""
    s = _admit(s)
    preempted: list[Sequence] = []
    if not s.config.chunked_prefill and any(seq.pending > 1 for seq in s.running):
        s, prefill = _whole_prompts(s, preempted)
        if prefill:
            return s, StepPlan([], prefill, preempted)
    decode = []
    for seq in list(s.running):
        # a sequence preempted earlier in this loop is no longer running
        if seq.pending == 1 and seq in s.running:
            s = _reserve(s, seq, seq.computed + 1, preempted)
            if seq in s.running:  # not preempted to find its own page
                decode.append(seq)
    prefill: list[tuple[Sequence, int]] = []
    chunk = 0
    budget = s.config.prefill_chunk
    if decode and s.config.prefill_chunk_decoding is not None:
        budget = s.config.prefill_chunk_decoding  # streams wait for this step: keep it short
    for seq in list(s.running) if s.config.chunked_prefill else []:  # else no prompt fits now
        if seq.pending <= 1 or seq not in s.running:
            continue
        # rows are padded to the first chunk's length; the padded batch stays within budget
        n = min(seq.pending, chunk or budget)
        chunk = chunk or n
        if (len(prefill) + 1) * chunk > budget:
            break
        s = _reserve(s, seq, seq.computed + n, preempted)
        if seq in s.running:
            prefill.append((seq, n))
    # a sequence preempted while pages were found for a later one is not in this step
    decode = [seq for seq in decode if seq in s.running]
    prefill = [(seq, n) for seq, n in prefill if seq in s.running]
    return s, StepPlan(decode, prefill, preempted)


def decode_run_length(plan: StepPlan, config: EngineConfig, step_seconds: float | None) -> int:
    """How many decode steps the plan runs back to back (see EngineConfig.decode_run): 1
    unless the step only decodes, every row already generates (none feeds its prompt's last
    token) and samples from its logits alone (no penalty window over its tokens, no grammar,
    no log-probs); then up to `decode_run`, as many as fit `decode_run_ms` at `step_seconds`
    a step (the caller's measure; None: not measured), and never past a row's max_tokens."""
    limit = config.decode_run
    if step_seconds is not None:
        # rounded, not cut: the measured time includes the caller's own work around the step
        fit = round(config.decode_run_ms / 1000 / max(step_seconds, 1e-6))
        limit = min(limit, max(fit, 1))
    if limit <= 1 or plan.prefill or not plan.decode:
        return 1
    for seq in plan.decode:
        sp = seq.sampling
        if seq.generated == 0 or seq.matcher is not None or sp.has_penalties or sp.logprobs:
            return 1
        limit = min(limit, seq.max_len - len(seq.tokens))
    return max(limit, 1)


def reserve_run(s: Scheduler, seqs: list[Sequence], steps: int) -> tuple[Scheduler, bool]:
    """Pages for `steps` more tokens of each decoding sequence in seqs, taken from the free
    pages only (no eviction, no preemption): for all of them, or for none and False."""
    need = [pages_for(seq.computed + steps, s.config.page_size) - len(seq.pages) for seq in seqs]
    if sum(need) > num_free_pages(s.pool):
        return s, False
    for seq, n in zip(seqs, need):
        if n > 0:
            s.pool, pages = alloc_pages(s.pool, n)
            seq.pages += pages
    return s, True


def finish_sequence(s: Scheduler, seq: Sequence, cache: bool = True) -> Scheduler:
    """Retire seq: offer its computed full pages to the prefix cache, then drop its pages."""
    if seq in s.running:
        s.running.remove(seq)
    elif seq in s.waiting:
        s.waiting.remove(seq)
    # a chain with pages given back no longer starts at the root: nothing to offer
    if cache and seq.cacheable and s.cache is not None and seq.pages and not seq.released:
        s.cache, s.pool = insert_prefix(
            s.cache, s.pool, seq.tokens[: seq.computed], seq.pages, seq.prefix_key
        )
    if _held(seq):
        s.pool = free_pages(s.pool, _held(seq))
    seq.pages, seq.released = [], 0
    return s


def advance(s: Scheduler, plan: StepPlan) -> Scheduler:
    """Record that the model ran the plan: the fed tokens' K/V are now in the pages."""
    for seq in plan.decode:
        s = fed(s, seq, 1)
    for seq, n in plan.prefill:
        s = fed(s, seq, n)
    return s


def fed(s: Scheduler, seq: Sequence, n: int) -> Scheduler:
    """Record that the K/V of seq's next n tokens are now in its pages. A prompt whose last
    token was just fed is offered to the prefix cache, so requests that arrive while it still
    runs can share its pages."""
    seq.computed += n
    prompt_done = seq.computed - n < seq.prompt_len <= seq.computed
    if prompt_done and seq.cacheable and s.cache is not None and not seq.released:
        s.cache, s.pool = insert_prefix(
            s.cache, s.pool, seq.tokens[: seq.computed], seq.pages, seq.prefix_key
        )
    return release_behind(s, seq)


def release_behind(s: Scheduler, seq: Sequence) -> Scheduler:
    """Give back seq's pages that lie wholly behind the window of every query still to come.
    The next query sits at position `computed` and sees keys from computed + 1 - window on, so
    page j (positions up to (j + 1) * page_size - 1) is never read again once
    (j + 1) * page_size <= computed + 1 - window. A prompt to be cached keeps its pages until
    it is done and offered (see fed)."""
    if s.window is None:
        return s
    if seq.computed < seq.prompt_len and not _releases_while_prefilling(s, seq):
        return s
    behind = min((seq.computed + 1 - s.window) // s.config.page_size, len(seq.pages))
    if behind <= seq.released:
        return s
    s.pool = free_pages(s.pool, seq.pages[seq.released : behind])
    seq.pages[seq.released : behind] = [RELEASED] * (behind - seq.released)
    seq.released = behind
    return s


def drop_prefix_cache(s: Scheduler) -> Scheduler:
    """The weights changed: drop the prefix cache, and never cache the K/V of the sequences
    that hold pages now (they mix old and new weights)."""
    if s.cache is not None:
        s.cache, s.pool = clear_prefix_cache(s.cache, s.pool)
    for seq in [*s.running, *s.waiting]:
        seq.cacheable = False
    return s


def drop_cached_key(s: Scheduler, key: object) -> Scheduler:
    """Drop the pages the prefix cache holds under `key` (an adapter unloaded)."""
    if s.cache is not None:
        s.cache, s.pool = drop_prefix_key(s.cache, s.pool, key)
    return s
