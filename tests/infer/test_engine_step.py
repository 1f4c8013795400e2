"""engine_step driven by hand, no thread: many requests arriving between steps, sharing
prefixes, preempted by a small pool and cancelled, give what full recomputation gives, and
every page comes back."""

from __future__ import annotations

import pytest
import torch
from infer_models import greedy_reference, make_model

import astrai as ai
from astrai.infer import PromptTooLong, engine_stats, forget_cached_kv, num_free_pages


def mixed_requests(cfg, n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs: one of three shared prefixes (or none) plus a tail of 1 to
    20 tokens, asking for 1 to 12 tokens."""
    g = torch.Generator().manual_seed(seed)

    def ints(low, high, size=()):
        return torch.randint(low, high, size, generator=g).tolist()

    prefixes = [ints(0, cfg.vocab_size, (k,)) for k in (8, 12, 16)] + [[]]
    return [
        (prefixes[ints(0, 4)] + ints(0, cfg.vocab_size, (ints(1, 21),)), ints(1, 13))
        for _ in range(n)
    ]


@pytest.mark.parametrize("chunked_prefill", [True, False])
def test_64_requests_by_hand_equal_recomputation_and_give_back_every_page(chunked_prefill):
    params, cfg = make_model("gqa")
    requests = mixed_requests(cfg, 64)
    # 48 pages of 4 tokens for up to 16 requests of up to 48 tokens: pages run out
    state = ai.init_engine(
        params, cfg, None, page_size=4, num_pages=48, max_batch=16, prefill_chunk=32,
        max_seq_len=64, chunked_prefill=chunked_prefill,
    )  # fmt: skip
    free_at_start = num_free_pages(state.sched.pool)
    prepared = ai.prepare_params(params)  # the decoding layout; same values
    # the last of every eight is cancelled: early (maybe still waiting) or after it started
    cancel_at = {f"r{i}": 2 + (i % 5) for i in range(7, 64, 8)}
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(64)}
    finals: dict[str, ai.StreamEvent] = {}
    step = 0
    while step == 0 or state.sched.running or state.sched.waiting or state.final_events:
        for i in range(8 * step, min(8 * step + 8, 64)):  # eight new requests a step
            prompt, n = requests[i]
            sampling = ai.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            state = ai.add_request(state, ai.Request(f"r{i}", prompt, sampling))
        for request_id, at in cancel_at.items():
            if at == step:
                state = ai.cancel_request(state, request_id)
        state, events = ai.engine_step(state, prepared)
        for event in events:
            assert event.request_id not in finals, "no event after the final one"
            tokens[event.request_id] += event.token_ids
            if event.finish_reason is not None:
                finals[event.request_id] = event
        step += 1
        assert step < 500

    stats = engine_stats(state)
    assert len(finals) == 64
    assert stats.preemptions > 0 and stats.cached_tokens > 0
    for i, (prompt, n) in enumerate(requests):
        rid = f"r{i}"
        expected = greedy_reference(params, cfg, prompt, n)
        if rid in cancel_at and finals[rid].finish_reason == "abort":
            assert tokens[rid] == expected[: len(tokens[rid])]
        else:
            assert finals[rid].finish_reason == "length"
            assert tokens[rid] == expected, rid
        assert finals[rid].usage.completion_tokens == len(tokens[rid])
    assert sum(e.finish_reason == "abort" for e in finals.values()) >= 4
    assert stats.pages_used == 0
    state = forget_cached_kv(state)  # the prefix cache hands its pages back too
    assert num_free_pages(state.sched.pool) == free_at_start


def run_sampled(params, cfg, requests, seeded=True, **settings):
    """Every event of sampled requests arriving a step apart (seeded, or drawing from the
    engine's seed), through 200 engine steps."""
    state = ai.init_engine(params, cfg, None, page_size=4, num_pages=40, max_batch=6, **settings)
    out = []
    for step in range(200):
        if step < len(requests):
            prompt, n = requests[step]
            seed = step if seeded else None
            sampling = ai.SamplingParams(max_tokens=n, temperature=0.9, top_p=0.9, seed=seed)
            state = ai.add_request(state, ai.Request(str(step), prompt, sampling))
        state, events = ai.engine_step(state, params)
        out += [(e.request_id, e.token_ids, e.finish_reason) for e in events]
    return out


def test_engine_step_is_deterministic_for_a_given_state():
    params, cfg = make_model("gqa")
    requests = mixed_requests(cfg, 12, seed=1)
    assert run_sampled(params, cfg, requests) == run_sampled(params, cfg, requests)


def test_requests_are_checked_when_added():
    params, cfg = make_model("gqa")
    state = ai.init_engine(params, cfg, None, max_seq_len=32)
    too_long = ai.Request("a", [1] * 30, ai.SamplingParams(max_tokens=5))
    with pytest.raises(PromptTooLong, match=r"max_seq_len \(32\)"):
        ai.add_request(state, too_long)
    assert not state.sched.waiting


def test_run_requests_completes_a_batch_as_recomputation_does():
    """run_requests: every request to its end, completions in the order given, the same
    completions on every call, pages all back; a request already running goes on."""
    params, cfg = make_model("gqa")
    requests = mixed_requests(cfg, 10, seed=2)
    state = ai.init_engine(params, cfg, None, page_size=4, num_pages=40, max_batch=4)
    running = ai.Request("before", requests[0][0], ai.SamplingParams(max_tokens=30))
    state = ai.add_request(state, running)
    batch = [
        ai.Request(f"r{i}", p, ai.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        for i, (p, n) in enumerate(requests)
    ]
    state, done = ai.run_requests(state, params, batch)
    for (prompt, n), completion in zip(requests, done):
        assert completion.token_ids == greedy_reference(params, cfg, prompt, n)
        assert completion.finish_reason == "length"
    assert any(seq.id == "before" for seq in state.sched.running)  # still going
    sampled = [
        ai.Request(str(i), p, ai.SamplingParams(max_tokens=n, temperature=0.9, seed=i))
        for i, (p, n) in enumerate(requests)
    ]
    fresh = [ai.init_engine(params, cfg, None, page_size=4, max_batch=10) for _ in range(2)]
    (state, first), (_, second) = (ai.run_requests(s, params, sampled) for s in fresh)
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert engine_stats(state).pages_used == 0


def test_requests_without_a_seed_draw_from_the_engine_seed():
    params, cfg = make_model("gqa")
    requests = mixed_requests(cfg, 6, seed=3)
    first = run_sampled(params, cfg, requests, seeded=False, seed=7)
    assert first == run_sampled(params, cfg, requests, seeded=False, seed=7)
    assert first != run_sampled(params, cfg, requests, seeded=False, seed=8)


def test_a_donated_engine_state_is_refused():
    params, cfg = make_model("gqa")
    state = ai.init_engine(params, cfg, None, page_size=4, num_pages=16)
    given = state
    state = ai.add_request(state, ai.Request("a", [1, 2, 3], ai.SamplingParams(max_tokens=4)))
    with pytest.raises(ai.DonatedError, match=r"add_request was given .* donated to add_request"):
        ai.add_request(given, ai.Request("b", [1, 2], ai.SamplingParams(max_tokens=2)))
    before_step = state
    state, _ = ai.engine_step(state, params)
    for reuse in (
        lambda: ai.engine_step(before_step, params),
        lambda: ai.cancel_request(before_step, "a"),
        lambda: engine_stats(before_step),
    ):
        with pytest.raises(ai.DonatedError, match="donated to engine_step"):
            reuse()
    state = ai.cancel_request(state, "a")
    state, events = ai.engine_step(state, params)
    assert events[-1].finish_reason == "abort"


def test_a_donated_page_pool_is_refused():
    pool = ai.init_pages(cfg_small(), num_pages=4, page_size=2)
    given = pool
    pool, pages = ai.alloc_pages(pool, 2)
    with pytest.raises(ai.DonatedError, match=r"page pool .* donated to alloc_pages"):
        ai.alloc_pages(given, 1)
    with pytest.raises(ai.DonatedError, match="donated to alloc_pages"):
        given["k"]
    freed = ai.free_pages(pool, pages)
    with pytest.raises(ai.DonatedError, match="donated to free_pages"):
        num_free_pages(pool)
    assert num_free_pages(freed) == 4
    with pytest.raises(ValueError, match="double free"):
        ai.free_pages(freed, pages)
    assert num_free_pages(freed) == 4  # a call that raised took nothing


def cfg_small():
    return ai.ModelConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)


def _events_by_request(params, cfg, requests, decode_run, num_pages=64):
    """Every request through engine_step with decode runs of up to decode_run steps ->
    ({id: [(token ids, finish_reason, usage)] per event}, engine_step calls, final state)."""
    state = ai.init_engine(
        params, cfg, None, page_size=4, num_pages=num_pages, max_batch=8, decode_run=decode_run
    )
    for request in requests:
        state = ai.add_request(state, request)
    events: dict[str, list] = {r.id: [] for r in requests}
    calls = 0
    while state.sched.running or state.sched.waiting or state.final_events:
        state, out = ai.engine_step(state, params)
        calls += 1
        for e in out:
            events[e.request_id].append((e.token_ids, e.finish_reason, e.usage))
    return events, calls, state


@pytest.mark.parametrize("decode_run", [2, 4, 7])
def test_decode_runs_give_what_single_steps_give(decode_run):
    # runs of decode steps: the same events as one step at a time, also for a request that
    # stops on a token inside a run, lengths that are no multiple of the run, seeded sampling
    # with a bias, a request with a penalty (steps run one at a time while it runs) and a
    # pool too small for some runs
    params, cfg = make_model("gqa")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 6, 9)]
    stop_at = greedy_reference(params, cfg, prompts[1], 12)[6]

    def greedy(n, **more):
        return ai.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **more)

    requests = [
        ai.Request("a", prompts[0], greedy(13)),
        ai.Request("b", prompts[1], greedy(12, stop_token_ids=[stop_at])),
        ai.Request("c", prompts[2], greedy(10)),
        ai.Request("s", prompts[2], ai.SamplingParams(max_tokens=9, temperature=0.9, seed=1)),
        ai.Request("t", prompts[0], ai.SamplingParams(max_tokens=11, seed=2, logit_bias={7: 3.0})),
        ai.Request("p", prompts[1], greedy(3, presence_penalty=1.0)),
    ]
    for num_pages in (64, 12):
        single, single_calls, _ = _events_by_request(params, cfg, requests, 1, num_pages)
        runs, run_calls, state = _events_by_request(params, cfg, requests, decode_run, num_pages)
        assert runs == single
        assert run_calls < single_calls
        assert single["b"][-1][1] == "stop"  # it stopped on the token, inside a run
        assert engine_stats(state).pages_used == 0
        assert num_free_pages(state.sched.pool) + engine_stats(state).pages_cached == num_pages
