"""A window-only model (every layer slides) gives back the pages wholly behind its window: the
engine holds about the window's pages however long a request grows, gives the tokens that full
recomputation gives, and keeps the page pool's references exact with the prefix cache on and
preemption; a model with a global layer gives nothing back."""

from __future__ import annotations

import pytest
import torch
from infer_models import BASE, greedy_reference

import astrai as ai
from astrai.infer import engine_stats, forget_cached_kv, num_free_pages, pages_for

WINDOW, PAGE = 8, 4
WINDOWED = ai.ModelConfig(**BASE, sliding_window=WINDOW)
MIXED = ai.ModelConfig(
    **BASE, sliding_window=WINDOW, layer_types=("sliding_attention", "full_attention")
)
# the most pages a window of K/V spans: one more than its own when it starts mid-page
WINDOW_PAGES = pages_for(WINDOW, PAGE) + 1


def test_the_attention_window_is_set_only_when_every_layer_slides():
    assert WINDOWED.attention_window == WINDOW
    every = ai.ModelConfig(**BASE, sliding_window=WINDOW, layer_types=("sliding_attention",) * 2)
    assert every.attention_window == WINDOW
    assert MIXED.attention_window is None
    assert ai.ModelConfig(**BASE).attention_window is None


def run(state, params, requests, check=None):
    """Every (id, prompt, max_tokens) joins, then engine_step until all finish -> (state,
    tokens by id, most pages used after a step once every request decodes: a prompt to be
    cached keeps its pages until it is done). check(state) runs after each step."""
    for rid, prompt, n in requests:
        sampling = ai.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        state = ai.add_request(state, ai.Request(rid, prompt, sampling))
    tokens = {rid: [] for rid, _, _ in requests}
    held = 0
    for _ in range(1000):
        if not (state.sched.running or state.sched.waiting or state.final_events):
            return state, tokens, held
        state, events = ai.engine_step(state, params)
        for event in events:
            tokens[event.request_id] += event.token_ids
        if all(tokens.values()):
            held = max(held, engine_stats(state).pages_used)
        if check is not None:
            check(state)
    raise AssertionError("the requests did not finish in 1000 steps")


@pytest.mark.parametrize("prefix_cache", [False, True])
@pytest.mark.parametrize("chunked_prefill", [True, False])
def test_decoding_far_past_the_window_equals_recomputation_and_holds_a_window(
    prefix_cache, chunked_prefill
):
    params = ai.init_params(WINDOWED, seed=3)
    prompt = torch.randint(
        0, WINDOWED.vocab_size, (21,), generator=torch.Generator().manual_seed(0)
    )
    prompt, n = prompt.tolist(), 60  # 81 tokens: ten windows
    settings = dict(
        page_size=PAGE, num_pages=64, max_batch=2, prefill_chunk=8, max_seq_len=128,
        prefix_cache=prefix_cache, chunked_prefill=chunked_prefill,
    )  # fmt: skip
    _, tokens, held = run(ai.init_engine(params, WINDOWED, **settings), params, [("a", prompt, n)])
    assert tokens["a"] == greedy_reference(params, WINDOWED, prompt, n)
    assert held <= WINDOW_PAGES

    kept = ai.init_engine(params, WINDOWED, **settings)
    kept.sched.window = None  # the same engine, keeping every page
    _, kept_tokens, kept_held = run(kept, params, [("a", prompt, n)])
    assert kept_tokens == tokens
    assert kept_held == pages_for(len(prompt) + n - 1, PAGE)  # the last token is never fed


def holders(state) -> torch.Tensor:
    """References each page should have: one per running sequence holding it, one for the
    prefix cache."""
    s = state.sched
    refs = torch.zeros_like(s.pool["refs"])
    for seq in s.running:
        assert all(p == -1 for p in seq.pages[: seq.released])
        for page in seq.pages[seq.released :]:
            refs[page] += 1
    for seq in s.waiting:
        assert not seq.pages and not seq.released
    for page in s.cache.nodes if s.cache is not None else ():
        refs[page] += 1
    return refs


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_references_equal_holders_with_shared_prefixes_and_preemption(seed):
    params = ai.init_params(WINDOWED, seed=seed)
    g = torch.Generator().manual_seed(seed)

    def ints(low, high, size=()):
        return torch.randint(low, high, size, generator=g).tolist()

    shared = [ints(0, WINDOWED.vocab_size, (k,)) for k in (6, 13, 20)] + [[]]
    requests = [
        (f"r{i}", shared[ints(0, 4)] + ints(0, WINDOWED.vocab_size, (ints(1, 12),)), ints(8, 18))
        for i in range(10)
    ]
    # 12 pages of 4 tokens for up to 5 requests of prompts up to 31 tokens: pages run out
    state = ai.init_engine(
        params, WINDOWED, page_size=PAGE, num_pages=12, max_batch=5, prefill_chunk=8,
        max_seq_len=64, prefix_cache=True,
    )  # fmt: skip
    free_at_start = num_free_pages(state.sched.pool)

    def check(state):
        assert torch.equal(state.sched.pool["refs"], holders(state))

    state, tokens, _ = run(state, params, requests, check)
    assert engine_stats(state).preemptions > 0
    assert engine_stats(state).cached_tokens > 0
    for rid, prompt, n in requests:
        assert tokens[rid] == greedy_reference(params, WINDOWED, prompt, n), rid
    assert engine_stats(state).pages_used == 0
    state = forget_cached_kv(state)
    assert num_free_pages(state.sched.pool) == free_at_start


def test_a_model_with_a_global_layer_gives_nothing_back():
    params = ai.init_params(MIXED, seed=4)
    prompt, n = list(range(1, 22)), 40
    state = ai.init_engine(
        params, MIXED, page_size=PAGE, num_pages=64, max_batch=1, prefill_chunk=8,
        max_seq_len=128, prefix_cache=False,
    )  # fmt: skip
    assert state.sched.window is None
    state, tokens, held = run(state, params, [("a", prompt, n)])
    assert tokens["a"] == greedy_reference(params, MIXED, prompt, n)
    assert held == pages_for(len(prompt) + n - 1, PAGE)
