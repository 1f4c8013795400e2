"""The target's pool and prefix cache under speculation: whatever sequence of proposals is
accepted or rejected, no page leaks, and every cached page holds the K/V of its own token
chain (so nothing rejected was ever cached)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from infer_models import make_model
from numerics import assert_close, forward_roundings

from astrai.infer import (
    alloc_pages,
    clear_prefix_cache,
    free_pages,
    init_pages,
    init_prefix_cache,
    insert_prefix,
    match_prefix,
    num_free_pages,
    pages_for,
    prefill,
    share_pages,
)
from astrai.infer.speculative import discard_after, verify_forward

# Few tokens, so prompts share cached prefixes; pages for four sequences of 9 + 6 x 5 tokens
# and their proposals, so no draw runs the pool dry (the engine's eviction is tested elsewhere).
PAGE_SIZE, NUM_PAGES, ALPHABET, MAX_STEPS = 2, 128, 3, 6
PARAMS, CFG = make_model("gqa")

step = st.tuples(
    st.lists(st.integers(0, ALPHABET - 1), max_size=4),  # proposed tokens
    st.integers(0, 4),  # how many are accepted (capped at the proposal's length)
    st.integers(0, ALPHABET - 1),  # the target's own token after them
    st.booleans(),  # offer the accepted tokens to the prefix cache after this step
)
request = st.tuples(
    st.lists(st.integers(0, ALPHABET - 1), min_size=1, max_size=9),
    st.lists(step, max_size=MAX_STEPS),
)


class Running:
    def __init__(self, tokens, steps):
        self.tokens, self.steps, self.pages, self.computed = list(tokens), list(steps), [], 0


def grow(pool, seq, positions):
    need = pages_for(positions, PAGE_SIZE) - len(seq.pages)
    if need > 0:
        pool, pages = alloc_pages(pool, need)
        assert pages is not None, f"the pool ran dry: {need} pages for {positions} positions"
        seq.pages += pages
    return pool


def admit(pool, cache, seq):
    """The engine's way in: cached full pages of the prompt, then every prompt token but the
    last (a verification feeds it with the first proposal)."""
    cache, cached = match_prefix(cache, seq.tokens[:-1])
    pool = share_pages(pool, cached)
    seq.pages, seq.computed = list(cached), len(cached) * PAGE_SIZE
    pool = grow(pool, seq, len(seq.tokens) - 1)
    if seq.computed < len(seq.tokens) - 1:
        chunk = torch.tensor([seq.tokens[seq.computed : -1]])
        _, pool = prefill(PARAMS, CFG, pool, chunk, torch.tensor([seq.pages]), seq.computed)
        seq.computed = len(seq.tokens) - 1
    return pool, cache


def speculate(pool, cache, seq):
    proposed, accepted, own, offer = seq.steps.pop(0)
    accepted = min(accepted, len(proposed))
    pool = grow(pool, seq, seq.computed + 1 + len(proposed))
    table = torch.tensor([seq.pages])
    _, pool = verify_forward(PARAMS, CFG, pool, seq.tokens[-1:], [proposed], [seq.computed], table)
    seq.tokens += [*proposed[:accepted], own]
    seq.computed += 1 + accepted
    pool, seq.pages = discard_after(pool, seq.pages, seq.computed)
    if offer:
        cache, pool = insert_prefix(cache, pool, seq.tokens[: seq.computed], seq.pages)
    return pool, cache


def finish(pool, cache, seq):
    cache, pool = insert_prefix(cache, pool, seq.tokens[: seq.computed], seq.pages)
    return free_pages(pool, seq.pages), cache


def check_references(pool, cache, running):
    holders = Counter(p for seq in running for p in seq.pages) + Counter(list(cache.nodes))
    expected = torch.zeros(NUM_PAGES, dtype=torch.int32)
    for page, n in holders.items():
        expected[page] = n
    assert torch.equal(pool["refs"], expected)


def check_cached_kv(pool, cache):
    """Each cached page against a fresh prefill of the tokens its chain stands for."""
    for page, node in cache.nodes.items():
        chain, up = [], node
        while up.parent is not None:
            chain[:0], up = list(up.chunk), up.parent
        fresh = init_pages(CFG, pages_for(len(chain), PAGE_SIZE), PAGE_SIZE)
        fresh, pages = alloc_pages(fresh, pages_for(len(chain), PAGE_SIZE))
        _, fresh = prefill(PARAMS, CFG, fresh, torch.tensor([chain]), torch.tensor([pages]), 0)
        for key in ("k", "v"):
            assert_close(pool[key][:, page], fresh[key][:, pages[-1]], forward_roundings(CFG, 40))


@settings(max_examples=25, deadline=None)
@given(requests=st.lists(request, min_size=1, max_size=4))
def test_no_page_leaks_and_nothing_rejected_is_cached(requests):
    pool, cache = init_pages(CFG, NUM_PAGES, PAGE_SIZE), init_prefix_cache(PAGE_SIZE)
    running = []
    with torch.no_grad():
        for tokens, steps in requests:  # all admitted first, then stepped in turns
            seq = Running(tokens, steps)
            pool, cache = admit(pool, cache, seq)
            running.append(seq)
            check_references(pool, cache, running)
        while running:
            for seq in list(running):
                if seq.steps:
                    pool, cache = speculate(pool, cache, seq)
                else:
                    pool, cache = finish(pool, cache, seq)
                    running.remove(seq)
                check_references(pool, cache, running)
        check_cached_kv(pool, cache)
    cache, pool = clear_prefix_cache(cache, pool)
    assert num_free_pages(pool) == NUM_PAGES


def test_discard_after_refuses_more_than_the_pages_hold():
    pool = init_pages(CFG, 4, PAGE_SIZE)
    pool, pages = alloc_pages(pool, 2)
    with pytest.raises(ValueError, match="keep"):
        discard_after(pool, pages, 5)
