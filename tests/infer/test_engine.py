"""The Engine: same tokens as full recomputation, however requests are batched, chunked,
cached or preempted; streams, cancellation, stop conditions, errors and page accounting."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch
from infer_models import BASE, CONFIGS, greedy_reference, make_model
from numerics import approx, assert_close, forward_roundings
from thread_names import named_threads, thread_names, threads_become

import astrai as ai
import astrai.infer.step as engine_module
from astrai.infer import Engine, Overloaded, PromptTooLong
from astrai.infer.hardware import _openmp, name_native_thread
from astrai.infer.worker import THREAD_NAME

GREEDY = dict(temperature=0.0, ignore_eos=True)


def prompts_for(cfg, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]


def wait_until_idle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.running == 0 and stats.waiting == 0:
            return stats
        time.sleep(0.01)
    raise AssertionError(f"engine still busy: {engine.stats()}")


def assert_pool_back(engine):
    stats = wait_until_idle(engine)
    assert stats.pages_used == 0
    assert stats.pages_free + stats.pages_cached == stats.pages_total


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_engine_equals_full_recomputation(kind):
    params, cfg = make_model(kind)
    prompts = prompts_for(cfg, [5, 11, 1, 17])
    # small pages and chunks: prompts span several pages and are prefilled in pieces
    with Engine(params, cfg, None, page_size=4, prefill_chunk=8, max_seq_len=64) as engine:
        outs = engine.generate(prompts, max_tokens=6, **GREEDY)
        assert_pool_back(engine)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(params, cfg, prompt, 6)
        assert out.finish_reason == "length"
        assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 6


def test_mixed_batch_equals_each_request_alone():
    params, cfg = make_model("gqa")
    prompts = prompts_for(cfg, [3, 9, 14, 6, 2], seed=1)
    lengths = [2, 9, 4, 7, 5]  # requests leave the batch at different steps
    with Engine(params, cfg, None, page_size=4, prefill_chunk=16, max_seq_len=64) as engine:
        ids = [engine.submit(p, max_tokens=n, **GREEDY) for p, n in zip(prompts, lengths)]
        batched = [engine.result(i).token_ids for i in ids]
    with Engine(params, cfg, None, page_size=4, max_seq_len=64, prefix_cache=False) as engine:
        alone = [
            engine.generate([p], max_tokens=n, **GREEDY)[0].token_ids
            for p, n in zip(prompts, lengths)
        ]
    assert batched == alone


def test_chunked_prefill_equals_one_shot():
    params, cfg = make_model("mla")
    prompts = prompts_for(cfg, [30, 21], seed=2)
    results = []
    for chunk in (3, 512):
        with Engine(params, cfg, None, page_size=4, prefill_chunk=chunk, max_seq_len=64) as e:
            results.append([c.token_ids for c in e.generate(prompts, max_tokens=5, **GREEDY)])
    assert results[0] == results[1]


@pytest.mark.parametrize("kind", ["gqa", "moe"])
def test_prefix_cache_hit_equals_miss(kind):
    params, cfg = make_model(kind)
    shared = prompts_for(cfg, [13], seed=3)[0]
    tails = prompts_for(cfg, [4, 5], seed=4)
    with Engine(params, cfg, None, page_size=4, max_seq_len=64) as engine:
        first = engine.generate([shared + tails[0]], max_tokens=5, **GREEDY)[0]
        second = engine.generate([shared + tails[1]], max_tokens=5, **GREEDY)[0]
        again = engine.generate([shared + tails[0]], max_tokens=5, **GREEDY)[0]
        assert engine.stats().prefix_cache_hit_rate > 0
        assert_pool_back(engine)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 12  # three full pages of the shared prefix
    assert again.usage.cached_tokens == 16  # every full page; the last partial one is fed
    assert second.token_ids == greedy_reference(params, cfg, shared + tails[1], 5)
    assert again.token_ids == first.token_ids


def test_preempted_and_recomputed_equals_never_preempted():
    params, cfg = make_model("gqa")
    prompts = prompts_for(cfg, [9, 7, 10, 8], seed=5)
    # 14 pages of 4 tokens cannot hold four sequences of ~30 tokens at once
    with Engine(params, cfg, None, num_pages=14, page_size=4, max_seq_len=64) as engine:
        outs = engine.generate(prompts, max_tokens=20, **GREEDY)
        assert engine.stats().preemptions > 0
        assert_pool_back(engine)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == greedy_reference(params, cfg, prompt, 20)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    params, cfg = make_model("gqa")
    prompts = prompts_for(cfg, [4, 8, 6], seed=6)
    sampling = dict(temperature=0.9, top_p=0.9, top_k=50, ignore_eos=True, max_tokens=8)
    with Engine(params, cfg, None, page_size=4, max_seq_len=64) as engine:
        batch = engine.generate(prompts, seed=123, **sampling)
        alone = [engine.generate([p], seed=123, **sampling)[0] for p in prompts]
    assert [c.token_ids for c in batch] == [c.token_ids for c in alone]


def test_sixty_four_concurrent_requests_from_threads():
    params, cfg = make_model("gqa")
    prompts = prompts_for(cfg, [3 + i % 9 for i in range(64)], seed=7)
    results = [None] * 64
    with Engine(params, cfg, None, page_size=4, max_seq_len=64, max_batch=64) as engine:

        def worker(i):
            events = list(engine.stream(prompts[i], max_tokens=4 + i % 5, **GREEDY))
            results[i] = events

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert_pool_back(engine)
        assert engine.stats().requests_finished == 64
    for i, events in enumerate(results):
        assert events[-1].finish_reason == "length"
        assert sum(len(e.token_ids) for e in events) == 4 + i % 5
    for i in (0, 17, 63):
        expected = greedy_reference(params, cfg, prompts[i], 4 + i % 5)
        assert [t for e in results[i] for t in e.token_ids] == expected


def test_cancelling_a_stream_frees_its_pages():
    params, cfg = make_model("gqa")
    # requests long enough to be still running when they are cancelled
    with Engine(params, cfg, None, page_size=4, max_seq_len=4096) as engine:
        stream = engine.stream(prompts_for(cfg, [10])[0], max_tokens=4000, **GREEDY)
        for _ in range(3):
            next(stream)
        while engine.stats().pages_used == 0:
            time.sleep(0.005)
        stream.close()  # leaving the loop early cancels the request
        assert_pool_back(engine)
        assert engine.stats().requests_aborted == 1

        request_id = engine.submit(prompts_for(cfg, [5])[0], max_tokens=4000, **GREEDY)
        engine.cancel(request_id)
        assert engine.result(request_id).finish_reason == "abort"
        assert_pool_back(engine)


def test_cancelling_an_async_stream_frees_its_pages():
    params, cfg = make_model("gqa")

    async def main(engine):
        events = []

        async def read():
            async for event in engine.astream(prompts_for(cfg, [6])[0], max_tokens=4000, **GREEDY):
                events.append(event)

        task = asyncio.create_task(read())
        while len(events) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        complete = [e async for e in engine.astream([1, 2, 3], max_tokens=3, **GREEDY)]
        return events, complete

    with Engine(params, cfg, None, page_size=4, max_seq_len=4096) as engine:
        events, complete = asyncio.run(main(engine))
        assert_pool_back(engine)
    assert events[-1].finish_reason is None
    assert complete[-1].finish_reason == "length" and complete[-1].usage.completion_tokens == 3


@pytest.mark.parametrize("interval_ms", [0, 60_000])
def test_async_readers_are_woken_once_per_hand_over(interval_ms):
    # every hand-over of events to a loop is one call_soon_threadsafe, carrying the events of
    # all its streams; within the interval only first tokens and ends go out at once
    params, cfg = make_model("gqa")
    prompts = prompts_for(cfg, [3, 5, 4], seed=3)
    wakes = []

    async def main(engine):
        loop = asyncio.get_running_loop()
        wake = loop.call_soon_threadsafe

        def counted(callback, items, *args):
            wakes.append([event for _, event in items])
            return wake(callback, items, *args)

        loop.call_soon_threadsafe = counted

        async def read(prompt):
            return [e async for e in engine.astream(prompt, max_tokens=6, **GREEDY)]

        return await asyncio.gather(*(read(p) for p in prompts))

    settings = dict(page_size=4, stream_interval_ms=interval_ms, decode_run=1)
    with Engine(params, cfg, None, **settings) as engine:
        streams = asyncio.run(main(engine))
        steps = engine.stats().steps
        expected = engine.generate(prompts, max_tokens=6, **GREEDY)
    for events, out in zip(streams, expected):
        assert [t for e in events for t in e.token_ids] == out.token_ids
        assert events[-1].finish_reason == "length"
    handed = sorted(id(e) for wake in wakes for e in wake)
    assert handed == sorted(id(e) for events in streams for e in events)  # each once
    if interval_ms == 0:
        # every step hands over its tokens, all streams' in one wake: 6 steps if the requests
        # joined together, more if the engine stepped between their arrivals
        assert all(len({e.request_id for e in wake}) == len(wake) for wake in wakes)
        assert 6 <= len(wakes) <= steps
        return
    firsts = {id(events[0]) for events in streams}
    finals = {id(events[-1]) for events in streams}
    # only a first token or an end wakes the loop (held tokens of its other streams go along)
    assert all({id(e) for e in wake} & (firsts | finals) for wake in wakes)
    assert not {id(e) for e in wakes[0]} & finals  # first tokens are not held
    assert len(wakes) <= 6


def tokenizer_model(tokenizer, seed=0):
    cfg = ai.ModelConfig(**{**BASE, "vocab_size": tokenizer.vocab_size})
    return ai.init_params(cfg, seed=seed), cfg


def test_stop_strings_never_reach_the_stream(tokenizer):
    params, cfg = tokenizer_model(tokenizer)
    prompt = "hello world, the quick"
    with Engine(params, cfg, tokenizer, page_size=4, max_seq_len=128) as engine:
        free = engine.generate([prompt], max_tokens=40, **GREEDY)[0]
        text = free.text
        assert len(text) > 12, text
        # stops that span token boundaries, somewhere in the middle of the text
        for stop in (text[5:9], text[10:11], text[3:12]):
            cut = text[: text.find(stop)]
            events = list(engine.stream(prompt, max_tokens=40, stop=[stop], **GREEDY))
            streamed = ""
            for event in events:
                streamed += event.text
                assert stop not in streamed
            assert streamed == cut
            assert events[-1].finish_reason == "stop"
            assert events[-1].stop_reason_text == stop
            completion = engine.generate([prompt], max_tokens=40, stop=[stop], **GREEDY)[0]
            assert completion.text == cut and completion.stop_reason_text == stop
        # a stop token: generation ends with it, its text is not emitted
        stop_id = free.token_ids[7]
        out = engine.generate([prompt], max_tokens=40, stop_token_ids=[stop_id], **GREEDY)[0]
        assert out.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
        assert out.finish_reason == "stop"
        assert text.startswith(out.text)
        assert_pool_back(engine)


def test_text_prompts_logprobs_and_usage(tokenizer):
    params, cfg = tokenizer_model(tokenizer, seed=1)
    prompt = "the lazy dog"
    with Engine(params, cfg, tokenizer, page_size=4, max_seq_len=128) as engine:
        out = engine.generate([prompt], max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)[0]
    ids = tokenizer.encode(prompt)
    logits = ai.forward(params, cfg, torch.tensor([ids + out.token_ids]))[0, len(ids) - 1 : -1]
    expected = logits.log_softmax(-1)
    for i, entry in enumerate(out.logprobs):
        assert entry.token_id == out.token_ids[i]
        # paged prefill/decode against one forward pass, then log_softmax over the vocabulary
        roundings = forward_roundings(cfg, len(ids) + 4) + cfg.vocab_size
        assert entry.logprob == approx(float(expected[i, out.token_ids[i]]), roundings)
        assert [t for t, _ in entry.top] == expected[i].topk(2).indices.tolist()
    assert out.text == tokenizer.decode(out.token_ids)
    assert out.usage.prompt_tokens == len(ids)


def test_errors_for_people():
    params, cfg = make_model("gqa")
    with Engine(params, cfg, None, page_size=4, num_pages=4, max_seq_len=64) as engine:
        with pytest.raises(PromptTooLong, match="max_seq_len"):
            engine.submit([1] * 60, max_tokens=10)
        with pytest.raises(PromptTooLong, match="page pool"):
            engine.submit([1] * 10, max_tokens=20)
        with pytest.raises(ValueError, match="out of range"):
            engine.submit([cfg.vocab_size])
        with pytest.raises(ValueError, match="empty"):
            engine.submit([])
        with pytest.raises(ValueError, match="temperature"):
            engine.submit([1], temperature=-1)
    engine = Engine(params, cfg, None, page_size=4, max_seq_len=4096, max_batch=1, max_waiting=1)
    with engine:
        # runs, the batch's one place, for longer than the test takes: a shorter one could end
        # between two looks at the stats, and the wait below would never end
        first = engine.submit([1, 2], max_tokens=4000, **GREEDY)
        deadline = time.monotonic() + 60
        while engine.stats().running == 0:
            assert time.monotonic() < deadline, "the first request never ran"
            time.sleep(0.005)
        engine.submit([1, 2], max_tokens=2)  # waits for that place
        with pytest.raises(Overloaded):
            engine.submit([1, 2], max_tokens=2)
        engine.cancel(first)


def test_max_waiting_zero_is_no_limit():
    params, cfg = make_model("gqa")
    with Engine(params, cfg, None, page_size=4, max_seq_len=64, max_batch=1, max_waiting=0) as e:
        ids = [e.submit([1, 2], max_tokens=2, **GREEDY) for _ in range(300)]
        assert all(e.result(i).finish_reason == "length" for i in ids)


def test_a_crashed_step_fails_its_requests_and_the_engine_goes_on(monkeypatch):
    params, cfg = make_model("gqa")
    real = engine_module.decode_step
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "decode_step", flaky)
    prompt = prompts_for(cfg, [6])[0]
    with Engine(params, cfg, None, page_size=4, max_seq_len=64) as engine:
        failed = engine.generate([prompt], max_tokens=5, **GREEDY)[0]
        assert failed.finish_reason == "error" and "boom" in failed.error
        assert_pool_back(engine)
        ok = engine.generate([prompt], max_tokens=5, **GREEDY)[0]
        assert engine.stats().requests_failed == 1
    assert ok.token_ids == greedy_reference(params, cfg, prompt, 5)


def test_update_params_swaps_weights_and_clears_the_cache():
    params, cfg = make_model("gqa", seed=0)
    other, _ = make_model("gqa", seed=1)
    prompt = prompts_for(cfg, [9])[0]
    with Engine(params, cfg, None, page_size=4, max_seq_len=64) as engine:
        engine.generate([prompt], max_tokens=3, **GREEDY)
        engine.update_params(other)
        assert engine.stats().pages_cached == 0
        out = engine.generate([prompt], max_tokens=5, **GREEDY)[0]
    assert out.usage.cached_tokens == 0
    assert out.token_ids == greedy_reference(other, cfg, prompt, 5)


def test_call_runs_on_the_engine_thread_with_its_weights():
    params, cfg = make_model("gqa")
    tokens = torch.tensor([prompts_for(cfg, [7])[0]])
    with Engine(params, cfg, None, page_size=4, max_seq_len=64) as engine:
        thread, logits = engine.call(
            lambda weights: (threading.current_thread().name, ai.forward(weights, cfg, tokens))
        )
        with pytest.raises(ZeroDivisionError):
            engine.call(lambda weights: 1 / 0)
        assert engine.generate([[1, 2, 3]], max_tokens=2, **GREEDY)[0].finish_reason == "length"
    assert thread == "astrai-engine"
    assert_close(logits, ai.forward(params, cfg, tokens), forward_roundings(cfg, tokens.shape[1]))


@pytest.mark.skipif(
    _openmp() is None or not Path("/proc/self/task").is_dir(),
    reason="ends OpenMP teams through torch's libgomp; counts threads in /proc",
)
def test_no_idle_openmp_team_is_left_beside_the_engines():
    """libgomp stops idle threads spinning once its teams outnumber the CPUs, and a decode step
    then runs at half speed: a thread that hands the engine work ends its team, and the engine
    thread ends its own when it runs out of work. A thread's team carries its name."""
    torch.set_num_threads(2)  # a team of two: one thread more (the fixture restores one)
    big, caller, counts = torch.rand(1 << 20), "team-caller", {}
    params, cfg = make_model("gqa")
    # other tests' engines, if any are still alive (they may end meanwhile: not counted)
    others = {t for t, name in named_threads().items() if name == THREAD_NAME}
    with Engine(params, cfg, None, page_size=4, max_seq_len=64) as engine:
        engine.call(lambda weights: big.sum())  # the engine thread's team
        assert threads_become(THREAD_NAME, 1, besides=others), "the idle engine kept its team"

        def hand_over():
            name_native_thread(caller)
            big.sum()  # this thread's team
            counts["with its team"] = thread_names().count(caller)
            engine.generate([[1, 2, 3]], max_tokens=2, **GREEDY)
            counts["after"] = thread_names().count(caller)

        thread = threading.Thread(target=hand_over)
        thread.start()
        thread.join()
        assert threads_become(THREAD_NAME, 1, besides=others)
    assert counts == {"with its team": 2, "after": 1}, "the caller's team outlived its hand-over"


def test_requests_running_across_update_params_are_not_cached():
    params, cfg = make_model("gqa", seed=0)
    other, _ = make_model("gqa", seed=1)
    with Engine(params, cfg, None, page_size=4, max_seq_len=64) as engine:
        stream = engine.stream(prompts_for(cfg, [9])[0], max_tokens=30, **GREEDY)
        next(stream)
        engine.update_params(other)
        assert list(stream)[-1].finish_reason == "length"
        assert_pool_back(engine)
        assert engine.stats().pages_cached == 0  # its K/V mix old and new weights


def test_close_aborts_what_is_left():
    params, cfg = make_model("gqa")
    engine = Engine(params, cfg, None, page_size=4, max_seq_len=4096)
    results = []
    waiter = threading.Thread(
        target=lambda: results.extend(engine.generate([[1, 2, 3]] * 3, max_tokens=4000, **GREEDY))
    )
    waiter.start()
    while engine.stats().running == 0:
        time.sleep(0.005)
    engine.close()
    waiter.join(timeout=10)
    assert [c.finish_reason for c in results] == ["abort"] * 3
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1])


def test_stats_report_the_engine():
    params, cfg = make_model("gqa")
    with Engine(params, cfg, None, page_size=4, max_seq_len=64, num_pages=32) as engine:
        engine.generate(prompts_for(cfg, [5, 6]), max_tokens=3, **GREEDY)
        stats = wait_until_idle(engine)
    assert stats.pages_total == 32
    assert stats.completion_tokens == 6 and stats.requests_finished == 2
    assert stats.prompt_tokens == 11
    assert isinstance(stats, ai.infer.EngineStats) and stats.uptime_s > 0


def test_requests_submitted_together_share_their_prompt_pages():
    params, cfg = make_model("gqa")
    prompt = prompts_for(cfg, [18])[0]
    with Engine(params, cfg, None, page_size=4, max_seq_len=64) as engine:
        outs = engine.generate([prompt] * 3, max_tokens=4, **GREEDY)
    assert [o.usage.cached_tokens for o in outs] == [0, 16, 16]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids


def test_a_failed_weight_swap_raises_to_its_caller_and_keeps_the_old_weights():
    params, cfg = make_model("gqa")
    prompt = prompts_for(cfg, [7])[0]
    with Engine(params, cfg, None, page_size=4, max_seq_len=64) as engine:
        with pytest.raises(AttributeError):
            engine.update_params({"model.embed_tokens.weight": "not a tensor"})
        out = engine.generate([prompt], max_tokens=4, **GREEDY)[0]
    assert out.token_ids == greedy_reference(params, cfg, prompt, 4)
