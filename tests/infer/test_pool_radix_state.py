"""The page pool and the prefix cache under random operations keep their invariants."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

import astrai as ai
from astrai.infer import (
    alloc_pages,
    evict,
    free_pages,
    init_pages,
    init_prefix_cache,
    insert_prefix,
    match_prefix,
    share_pages,
)

CFG = ai.ModelConfig(vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)
NUM_PAGES, PAGE_SIZE = 10, 2
tokens_of = st.lists(st.integers(0, 1), min_size=0, max_size=4 * PAGE_SIZE + 1)


class PoolAndCache(RuleBasedStateMachine):
    holders = Bundle("holders")  # each holder keeps one reference on each of its pages

    def __init__(self):
        super().__init__()
        self.pool = init_pages(CFG, NUM_PAGES, PAGE_SIZE)
        self.cache = init_prefix_cache(PAGE_SIZE)
        self.held: dict[int, list[int]] = {}  # holder id -> pages
        self.chains: dict[tuple, int] = {}  # reference model: token prefix -> cached page
        self.next_id = 0

    def _new_holder(self, pages):
        self.next_id += 1
        self.held[self.next_id] = list(pages)
        return self.next_id

    def _refs(self):
        return self.pool["refs"].tolist()

    @rule(target=holders, n=st.integers(1, 4))
    def alloc(self, n):
        before = self._refs()
        self.pool, pages = alloc_pages(self.pool, n)
        if pages is None:
            assert before.count(0) < n
            assert self._refs() == before  # nothing taken
            return self._new_holder([])
        assert len(set(pages)) == n
        assert all(before[p] == 0 for p in pages)  # never handed out twice
        return self._new_holder(pages)

    @rule(holder=consumes(holders))
    def free(self, holder):
        self.pool = free_pages(self.pool, self.held.pop(holder))

    @rule(target=holders, holder=holders)
    def share(self, holder):
        self.pool = share_pages(self.pool, self.held[holder])
        return self._new_holder(self.held[holder])

    @rule(holder=holders, data=st.data())
    def insert(self, holder, data):
        pages = self.held[holder]
        extra = data.draw(st.integers(0, PAGE_SIZE - 1))  # a partial page is never cached
        tokens = data.draw(
            st.lists(st.integers(0, 1), min_size=len(pages) * PAGE_SIZE + extra).map(
                lambda t: t[: len(pages) * PAGE_SIZE + extra]
            )
        )
        self.cache, self.pool = insert_prefix(self.cache, self.pool, tokens, pages)
        cached_pages = set(self.chains.values())
        for k, page in enumerate(pages):
            key = tuple(tokens[: (k + 1) * PAGE_SIZE])
            if key not in self.chains:
                if page in cached_pages:
                    break
                self.chains[key] = page
                cached_pages.add(page)

    @rule(target=holders, tokens=tokens_of, lock=st.booleans())
    def lookup(self, tokens, lock):
        self.cache, pages = match_prefix(self.cache, tokens)
        expected = []
        for k in range(len(tokens) // PAGE_SIZE):
            page = self.chains.get(tuple(tokens[: (k + 1) * PAGE_SIZE]))
            if page is None:
                break
            expected.append(page)
        assert pages == expected  # only whole matching chains, exactly
        if lock:  # a sequence admitted with a cache hit locks the pages it reuses
            self.pool = share_pages(self.pool, pages)
            return self._new_holder(pages)
        return self._new_holder([])

    @rule(n=st.integers(1, NUM_PAGES))
    def run_evict(self, n):
        before = self._refs()
        cached_before = set(self.chains.values())
        self.cache, self.pool, freed = evict(self.cache, self.pool, n)
        after = self._refs()
        gone = cached_before - set(self.cache.nodes)
        assert len(gone) == freed <= n
        for page in gone:
            assert before[page] == 1  # only the cache held it
            assert after[page] == 0
        self.chains = {k: p for k, p in self.chains.items() if p not in gone}

    @invariant()
    def counts_match_holders(self):
        refs = self._refs()
        assert min(refs) >= 0
        expected = [0] * NUM_PAGES
        for pages in self.held.values():
            for p in pages:
                expected[p] += 1
        for p in self.cache.nodes:
            expected[p] += 1
        assert refs == expected

    @invariant()
    def every_page_in_exactly_one_state(self):
        refs = self._refs()
        owned = {p for pages in self.held.values() for p in pages}
        cached = set(self.cache.nodes) - owned
        free = {p for p in range(NUM_PAGES) if refs[p] == 0}
        assert not (free & owned) and not (free & cached) and not (owned & cached)
        assert len(free) + len(owned) + len(cached) == NUM_PAGES

    @invariant()
    def cache_matches_model(self):
        assert set(self.cache.nodes) == set(self.chains.values())


TestPoolAndCache = PoolAndCache.TestCase
TestPoolAndCache.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
