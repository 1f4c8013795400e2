"""LoRA adapters in the engine: a batch mixing adapters and base rows gives each request what
its merged model gives alone; loading and unloading while requests run changes none of them,
leaks no page, and no adapter is served another's K/V from the prefix cache; what does not fit
is refused by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from infer_models import every_int8, make_model
from numerics import assert_close, forward_roundings

import astrai as ai
from astrai.config import LoraConfig
from astrai.infer import (
    AdapterError,
    AdapterInUse,
    AdapterMismatch,
    Engine,
    Request,
    SamplingParams,
    UnknownAdapter,
    adapter_list,
    init_engine,
    load_adapter,
    num_free_pages,
    prepare,
    run_requests,
    unload_adapter,
)
from astrai.infer import adapters as adapters_module
from astrai.infer import step as step_module
from astrai.infer.radix import num_cached_pages
from astrai.infer.step import engine_step
from astrai.infer.support import products_here

RANK = 4
EVERY = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SETTINGS = dict(page_size=4, max_seq_len=64, max_adapter_rank=RANK, adapter_targets=EVERY)


def trained(params, cfg, seed: int, rank: int = RANK, targets=EVERY, size: float = 0.3):
    """(lora params, LoraConfig) with random B, as if trained: updates that move the logits far
    beyond any rounding, so a row given another row's adapter (or its K/V) shows."""
    alpha = 2.0 * rank
    lora = ai.init_lora(params, cfg, rank, alpha, targets, seed)
    g = torch.Generator().manual_seed(1000 + seed)
    for pair in lora["weights"].values():
        pair["B"] = torch.randn(pair["B"].shape, generator=g) * size
    return lora, LoraConfig(rank=rank, alpha=alpha, targets=targets)


def eight_adapters(params, cfg) -> dict:
    """Eight adapters of different ranks (padded in the stack) and modules."""
    subsets = [EVERY, ("q_proj", "v_proj"), ("down_proj",), EVERY[:4], EVERY[4:]]
    return {
        f"ad{i}": trained(params, cfg, i + 1, rank=1 + i % RANK, targets=subsets[i % 5])
        for i in range(8)
    }


def prompts_for(cfg, n: int, seed: int = 0, longest: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # the longest first: a step's prompt chunks are as long as its first (scheduler.plan_step)
    lengths = [longest, *torch.randint(3, longest, (n - 1,), generator=g).tolist()]
    return [torch.randint(0, cfg.vocab_size, (k,), generator=g).tolist() for k in lengths]


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True, top_logprobs=3)


def logprob_rows(completion) -> torch.Tensor:
    """The chosen and top log-probabilities of every generated token, [tokens, 4]."""
    return torch.tensor(
        [[lp.logprob, *(v for _, v in lp.top)] for lp in completion.logprobs], dtype=torch.float32
    )


def alone(params, cfg, prompt, sampling=GREEDY, **settings):
    """One request served alone by an engine over `params` (a merged model, or the base)."""
    state = init_engine(params, cfg, None, page_size=4, max_seq_len=64, **settings)
    _, (done,) = run_requests(state, params, [Request("alone", prompt, sampling)])
    return done


@pytest.mark.parametrize("longest", [11, 30])
def test_a_batch_of_eight_adapters_and_base_rows_gives_each_merged_model(longest, monkeypatch):
    """Short prompts prefill with every adapter masked per row; long ones group the rows by
    adapter (batch_lora); decoding masks."""
    ways = []
    for way in ("grouped_lora", "mixed_lora"):
        bind = getattr(adapters_module, way)
        monkeypatch.setattr(
            adapters_module, way, lambda *a, bind=bind, way=way: ways.append(way) or bind(*a)
        )
    params, cfg = make_model("gqa")
    adapters = eight_adapters(params, cfg)
    names = [*adapters, None, None]
    prompts = prompts_for(cfg, len(names), longest=longest)
    state = init_engine(params, cfg, None, max_adapters=8, **SETTINGS)
    for name, (lora, lora_cfg) in adapters.items():
        state = load_adapter(state, name, lora, lora_cfg)
    requests = [
        Request(f"r{i}", p, GREEDY, adapter=name) for i, (p, name) in enumerate(zip(prompts, names))
    ]
    state, done = run_requests(state, params, requests)
    roundings = forward_roundings(cfg, longest + 6) + RANK  # merging sums W + s * B @ A first
    for request, got in zip(requests, done):
        name = request.adapter
        merged = params if name is None else ai.merge_lora(params, adapters[name][0])
        want = alone(merged, cfg, request.prompt)
        assert got.token_ids == want.token_ids, name
        assert_close(logprob_rows(got), logprob_rows(want), roundings)
    # every adapter moves its row's first log-probabilities far beyond the tolerance, so a
    # row given another's update (or none) would fail
    for request, got in zip(requests[:8], done):
        base = logprob_rows(alone(params, cfg, request.prompt))[0]
        moved = (logprob_rows(got)[0] - base).abs().max().item()
        assert moved > 10 * roundings * torch.finfo(torch.float32).eps * base.abs().max().item()
    assert ways[0] == ("grouped_lora" if longest > 16 else "mixed_lora")
    assert set(ways[1:]) == {"mixed_lora"}  # the decode steps


def test_decode_runs_give_each_row_its_adapters_tokens(monkeypatch):
    """Runs of decode steps back to back (no log-probs asked) bind the batch once for the run:
    the same tokens as one step at a time."""
    runs = []
    decode_run = step_module._decode_run
    monkeypatch.setattr(step_module, "_decode_run", lambda *a: runs.append(a[3]) or decode_run(*a))
    params, cfg = make_model("gqa")
    adapters = dict(list(eight_adapters(params, cfg).items())[:4])
    names = [*adapters, None]
    prompts = prompts_for(cfg, len(names), seed=2)
    greedy = SamplingParams(max_tokens=9, temperature=0.0)
    done = {}
    for run in (1, 4):
        state = init_engine(params, cfg, None, decode_run=run, **SETTINGS)
        for name, (lora, lora_cfg) in adapters.items():
            state = load_adapter(state, name, lora, lora_cfg)
        requests = [Request(f"r{i}", p, greedy, n) for i, (p, n) in enumerate(zip(prompts, names))]
        done[run] = [c.token_ids for c in run_requests(state, params, requests)[1]]
    assert runs and all(steps > 1 for steps in runs)  # decode_run=4 ran steps back to back
    assert done[4] == done[1]
    assert done[1][-1] == alone(params, cfg, prompts[-1], greedy).token_ids  # the base row


def test_speculation_verifies_each_row_with_its_adapter():
    """Prompt lookup over a batch of adapter and base rows: the verification forward runs each
    row's adapter, so greedy tokens equal those decoded without speculation."""
    params, cfg = make_model("gqa")
    adapters = dict(list(eight_adapters(params, cfg).items())[:3])
    names = [*adapters, None]
    prompts = [p * 3 for p in prompts_for(cfg, len(names), seed=3, longest=6)]  # repeats: lookup
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    done, totals = {}, None
    for speculative in (None, "lookup"):
        state = init_engine(params, cfg, None, speculative=speculative, **SETTINGS)
        for name, (lora, lora_cfg) in adapters.items():
            state = load_adapter(state, name, lora, lora_cfg)
        requests = [Request(f"r{i}", p, greedy, n) for i, (p, n) in enumerate(zip(prompts, names))]
        state, completions = run_requests(state, params, requests)
        done[speculative], totals = [c.token_ids for c in completions], state.totals
    assert totals.spec_accepted > 0
    assert done["lookup"] == done[None]


ENGINE_KINDS = [
    pytest.param({}, id="float32-prepared"),
    pytest.param({"dtype": "bfloat16"}, id="bfloat16-prepared"),
    pytest.param(
        {"quantize": "int8"},
        id="int8",
        marks=pytest.mark.skipif(
            products_here(torch.int8, (64, 32)).get("weight_only") is not None,
            reason="the weight-only int8 product does not run here",
        ),
    ),
]


@pytest.mark.parametrize("settings_", ENGINE_KINDS)
def test_the_engine_serves_mixed_adapters_over_prepared_bf16_and_int8_weights(
    settings_, monkeypatch
):
    """Through the Engine (weights prepared: q/k/v and gate/up fused; or 8-bit), each row of a
    mixed batch gives what that adapter's request gives served alone by the same engine: the
    same products, in a batch of another size. (8 bits through the weight-only product: the
    dynamic one scales a whole call's activations at once, so a row's result depends on the
    rows beside it, see test_int8.py.)"""
    monkeypatch.setattr(prepare, "int8_products", every_int8("weight_only"))
    params, cfg = make_model("gqa")
    adapters = dict(list(eight_adapters(params, cfg).items())[:3])
    names = ["ad0", None, "ad1", "ad2", "ad0"]
    prompts = prompts_for(cfg, len(names), seed=1)
    with Engine(params, cfg, None, **SETTINGS, **settings_) as engine:
        for name, source in adapters.items():
            engine.load_adapter(name, source)
        mixed = engine.generate(prompts, GREEDY, adapter=names)
        single = [engine.generate([p], GREEDY, adapter=n)[0] for p, n in zip(prompts, names)]
    low = settings_ != {}  # bf16 activations (int8's products may round them to bf16 too)
    dtype = torch.bfloat16 if low else torch.float32
    roundings = 8 * cfg.num_hidden_layers if low else forward_roundings(cfg, 20)
    for got, want in zip(mixed, single):
        assert got.token_ids == want.token_ids
        scale = torch.finfo(dtype).eps / torch.finfo(torch.float32).eps
        assert_close(logprob_rows(got), logprob_rows(want), roundings * scale)


def test_a_folder_loads_as_its_adapter_in_memory(tmp_path):
    params, cfg = make_model("gqa")
    lora, lora_cfg = trained(params, cfg, 3)
    ai.save_lora(tmp_path / "run" / "adapter", lora, cfg)
    prompt = prompts_for(cfg, 1)[0]
    with Engine(params, cfg, None, **SETTINGS) as engine:
        info = engine.load_adapter("folder", tmp_path / "run")  # a `just train` run folder
        engine.load_adapter("memory", (lora, lora_cfg))
        assert (info.rank, info.targets) == (RANK, tuple(sorted(EVERY)))
        assert [a.name for a in engine.adapters()] == ["folder", "memory"]
        a, b = (engine.generate([prompt], GREEDY, adapter=n)[0] for n in ("folder", "memory"))
    assert a.token_ids == b.token_ids


def test_unknown_adapters_are_refused_on_submit():
    params, cfg = make_model("gqa")
    with Engine(params, cfg, None, **SETTINGS) as engine:
        engine.load_adapter("a", trained(params, cfg, 1))
        for call in (
            lambda: engine.submit([1, 2], adapter="zz", max_tokens=4),
            lambda: engine.stream([1, 2], adapter="zz", max_tokens=4),
            lambda: engine.generate([[1, 2], [3]], adapter=["a", "zz"], max_tokens=4),
        ):
            with pytest.raises(UnknownAdapter, match=r"'zz' is not loaded \(loaded: \['a'\]\)"):
                call()
        with pytest.raises(UnknownAdapter, match="'zz' is not loaded"):
            engine.unload_adapter("zz")
        assert engine.stats().waiting == 0
    state = init_engine(params, cfg, None, **SETTINGS)
    with pytest.raises(UnknownAdapter, match="'a' is not loaded"):
        ai.infer.add_request(state, Request("x", [1, 2], SamplingParams(max_tokens=4), "a"))


def test_what_does_not_fit_is_named():
    params, cfg = make_model("gqa")
    state = init_engine(params, cfg, None, page_size=4, max_seq_len=64)
    state = load_adapter(state, "qv", *trained(params, cfg, 1, rank=2, targets=("q_proj",)))
    with pytest.raises(AdapterMismatch, match="rank 4, above the engine's adapter rank 2"):
        load_adapter(state, "big", *trained(params, cfg, 2, rank=4, targets=("q_proj",)))
    with pytest.raises(AdapterMismatch, match=r"adapts model\.layers\.0\.mlp\.down_proj; .*q_proj"):
        load_adapter(state, "mlp", *trained(params, cfg, 3, rank=2, targets=("down_proj",)))
    lora, lora_cfg = trained(params, cfg, 4, rank=2, targets=("q_proj",))
    key = "model.layers.1.self_attn.q_proj.weight"
    lora["weights"][key]["A"] = torch.zeros(2, cfg.hidden_size + 1)
    with pytest.raises(AdapterMismatch, match=r"q_proj has A \(2, 33\) and B \(32, 2\).*\(2, 32\)"):
        load_adapter(state, "wide", lora, lora_cfg)
    lora["weights"] = {"model.layers.9.self_attn.q_proj.weight": lora["weights"][key]}
    with pytest.raises(AdapterMismatch, match=r"layers\.9\.self_attn\.q_proj is not one"):
        load_adapter(state, "deep", lora, lora_cfg)
    with pytest.raises(AdapterError, match="'qv' is already loaded"):
        load_adapter(state, "qv", *trained(params, cfg, 1, rank=2, targets=("q_proj",)))
    full = init_engine(params, cfg, None, page_size=4, max_seq_len=64, max_adapters=1)
    full = load_adapter(full, "one", *trained(params, cfg, 1, rank=2, targets=("q_proj",)))
    with pytest.raises(AdapterError, match="no free adapter slot for 'two'"):
        load_adapter(full, "two", *trained(params, cfg, 2, rank=2, targets=("q_proj",)))
    assert [a.name for a in adapter_list(state)] == ["qv"]  # a refused load changes nothing


def test_unloading_an_adapter_in_use_is_refused_with_the_count():
    params, cfg = make_model("gqa")
    state = init_engine(params, cfg, None, max_batch=1, **SETTINGS)
    state = load_adapter(state, "a", *trained(params, cfg, 1))
    long = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(3):  # one runs, two wait (max_batch=1)
        state = ai.infer.add_request(state, Request(f"r{i}", [1, 2, 3], long, adapter="a"))
    state, _ = engine_step(state, params)
    with pytest.raises(AdapterInUse, match="'a' is used by 3 running or waiting") as refused:
        unload_adapter(state, "a")
    assert refused.value.count == 3
    while state.sched.running or state.sched.waiting:
        state, _ = engine_step(state, params)
    state = unload_adapter(state, "a")
    assert adapter_list(state) == [] and state.adapters.stack is None


# ------------------------------------------------------------------ load / unload while running

VARIANTS = 3  # each name may be loaded again with other weights after an unload
NAMES = ("a", "b", "c")
PROMPTS = [[7, 8, 9, 10, 11, 12, 13, 14, 15], [7, 8, 9, 10, 11, 12, 13, 14, 40], [3, 4, 5]]
SAMPLED = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=2)


def variant(params, cfg, name: str, version: int):
    return trained(params, cfg, 10 * NAMES.index(name) + version, targets=("q_proj", "v_proj"))


_alone_cache: dict = {}


def served_alone(params, cfg, name, version, prompt_index):
    """What the request gives alone, with only its adapter (version) loaded."""
    key = (name, version, prompt_index)
    if key not in _alone_cache:
        state = init_engine(params, cfg, None, **SETTINGS)
        request = Request("alone", PROMPTS[prompt_index], SAMPLED, adapter=name)
        if name is not None:
            state = load_adapter(state, name, *variant(params, cfg, name, version))
        _alone_cache[key] = run_requests(state, params, [request])[1][0]
    return _alone_cache[key]


OPERATIONS = st.lists(
    st.one_of(
        st.tuples(st.just("submit"), st.sampled_from((*NAMES, None)), st.integers(0, 2)),
        st.tuples(st.just("load"), st.sampled_from(NAMES), st.integers(0, VARIANTS - 1)),
        st.tuples(st.just("unload"), st.sampled_from(NAMES), st.just(0)),
        st.tuples(st.just("step"), st.just(None), st.integers(1, 3)),
    ),
    max_size=24,
)


@settings(max_examples=25, deadline=None)
@given(OPERATIONS)
def test_loading_and_unloading_while_requests_run_changes_no_output(operations):
    params, cfg = make_model("gqa")
    state = init_engine(params, cfg, None, num_pages=24, max_batch=4, max_adapters=2, **SETTINGS)
    versions: dict[str, int] = {}  # the version of each loaded name
    requests: dict[str, tuple] = {}  # id -> (adapter, version, prompt index)
    events: dict[str, list] = {}

    def step(state):
        state, out = engine_step(state, params)
        for event in out:
            events.setdefault(event.request_id, []).append(event)
        return state

    for op, name, n in operations:
        if op == "submit" and (name is None or name in versions):
            rid = f"r{len(requests)}"
            requests[rid] = (name, versions.get(name), n)
            state = ai.infer.add_request(state, Request(rid, PROMPTS[n], SAMPLED, adapter=name))
        elif op == "submit":
            with pytest.raises(UnknownAdapter):
                ai.infer.add_request(state, Request("x", PROMPTS[n], SAMPLED, adapter=name))
        elif op == "load" and name not in versions and len(versions) < 2:
            state = load_adapter(state, name, *variant(params, cfg, name, n))
            versions[name] = n
        elif op == "unload" and name in versions:
            users = sum(
                requests[s.id][0] == name for s in (*state.sched.running, *state.sched.waiting)
            )
            if users:
                with pytest.raises(AdapterInUse):
                    unload_adapter(state, name)
            else:
                state = unload_adapter(state, name)
                del versions[name]
        elif op == "step":
            for _ in range(n):
                state = step(state)
    while state.sched.running or state.sched.waiting or state.final_events:
        state = step(state)
    for rid, (name, version, prompt) in requests.items():
        got = ai.infer.events.collect(events[rid])
        want = served_alone(params, cfg, name, version, prompt)
        assert got.token_ids == want.token_ids, (rid, name, version)
        assert_close(logprob_rows(got), logprob_rows(want), forward_roundings(cfg, 16))
    pool = state.sched.pool
    assert num_free_pages(pool) + num_cached_pages(state.sched.cache) == 24
    assert int(pool["refs"].sum()) == num_cached_pages(state.sched.cache)
    for name in list(versions):
        state = unload_adapter(state, name)
    assert not state.sched.cache.roots  # no adapter's pages outlive it
    assert int(state.sched.pool["refs"].sum()) == num_cached_pages(state.sched.cache)
