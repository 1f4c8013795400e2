"""The page pool and the prefix cache under random proposals and random accept / reject
decisions through the engine state: no page leaked, and neither the prefix cache nor a
running request holds the K/V of a rejected token (their K/V equal a recomputation)."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, given, settings
from infer_models import make_model
from numerics import assert_close, forward_roundings

from astrai.infer import speculate_step
from astrai.infer.acceptance import Verdict
from astrai.infer.paged import prefill
from astrai.infer.pages import alloc_pages, init_pages, pages_for
from astrai.infer.requests import Request
from astrai.infer.sampling import SamplingParams
from astrai.infer.state import add_request, has_work, init_engine
from astrai.infer.step import engine_step

PARAMS, CFG = make_model("gqa", seed=0)
PAGE_SIZE, NUM_PAGES = 4, 24


def _recomputed(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V of `tokens` computed afresh: [layers, len(tokens), ...] each."""
    n = pages_for(len(tokens), PAGE_SIZE)
    pool, pages = alloc_pages(init_pages(CFG, n, PAGE_SIZE), n)
    _, pool = prefill(PARAMS, CFG, pool, torch.tensor([tokens]), torch.tensor([pages]), 0)
    flat = [pool[x][:, pages].flatten(1, 2)[:, : len(tokens)] for x in ("k", "v")]
    return flat[0], flat[1]


def _check_kv(pool, tokens: list[int], pages: list[int]) -> None:
    """The pool's K/V of `tokens`, held in `pages` in order, equal a recomputation."""
    k, v = _recomputed(tokens)
    for x, expected in (("k", k), ("v", v)):
        held = pool[x][:, pages].flatten(1, 2)[:, : len(tokens)]
        assert_close(held, expected, forward_roundings(CFG, len(tokens)))


def _cached_chains(cache):
    """(tokens, pages) of every node of the radix cache, from the root."""
    stack = [(cache.root, [], [])]
    while stack:
        node, tokens, pages = stack.pop()
        for child in node.children.values():
            chain = (tokens + list(child.chunk), [*pages, child.page])
            yield chain
            stack.append((child, *chain))


def _check_state(state) -> None:
    s = state.sched
    refs = s.pool["refs"].tolist()
    expected = [0] * NUM_PAGES
    for seq in s.running:
        for page in seq.pages[seq.released :]:
            expected[page] += 1
        # what a running request has fed is the K/V of its accepted tokens
        if seq.computed:
            _check_kv(s.pool, seq.tokens[: seq.computed], seq.pages)
    for page in s.cache.nodes:
        expected[page] += 1
    assert refs == expected  # no page leaked, none freed twice
    for tokens, pages in _cached_chains(s.cache):
        _check_kv(s.pool, tokens, pages)


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    heads=st.lists(st.lists(st.integers(0, 299), min_size=1, max_size=9), min_size=1, max_size=3),
    tails=st.lists(st.integers(0, 2), min_size=2, max_size=6),
    seed=st.integers(0, 2**16),
)
def test_random_accepts_keep_pool_and_cache_consistent(monkeypatch, heads, tails, seed):
    """Prompts share heads (so the prefix cache is used); proposals are random tokens and each
    verification keeps a random number of them (then the target's argmax), in a pool small
    enough to evict and preempt."""
    rng = random.Random(seed)

    def random_proposal(index, k):
        return [rng.randrange(300) for _ in range(rng.randrange(k + 1))]

    def random_verdict(logits, proposal, sp, generator, history, allowed=None):
        kept = rng.randrange(len(proposal.tokens) + 1)
        return Verdict([*proposal.tokens[:kept], int(logits[kept].argmax())], kept)

    monkeypatch.setattr(speculate_step, "propose_lookup", random_proposal)
    monkeypatch.setattr(speculate_step, "verify_sampled", random_verdict)
    monkeypatch.setattr(speculate_step, "worth_verifying", lambda *a: True)
    monkeypatch.setattr(speculate_step, "RATE_FLOOR", 0.0)  # no row watches or pauses
    monkeypatch.setattr(speculate_step, "RATE_RESUME", 0.0)
    state = init_engine(
        PARAMS,
        CFG,
        None,
        max_batch=4,
        page_size=PAGE_SIZE,
        num_pages=NUM_PAGES,
        speculative="lookup",
        decode_run=1,
    )
    for i, tail in enumerate(tails):
        prompt = heads[i % len(heads)] * 3 + [tail]
        sp = SamplingParams(max_tokens=rng.randrange(1, 14), temperature=0.0)
        state = add_request(state, Request(str(i), prompt, sp))
    while has_work(state):
        state, _ = engine_step(state, PARAMS)
        _check_state(state)
    assert state.sched.pool["refs"].tolist().count(0) + len(state.sched.cache.nodes) == NUM_PAGES
