"""Speculative decoding in the engine step: greedy output token for token equal to plain
decoding, sampled output with the target's distribution, settings checked."""

from __future__ import annotations

import random

import msgspec
import pytest
from infer_models import make_model
from numerics import approx, forward_roundings

import astrai as ai
from astrai.config import EngineConfig
from astrai.infer import speculate_step
from astrai.infer.constraints import regex
from astrai.infer.requests import Request
from astrai.infer.sampling import SamplingParams
from astrai.infer.sequence import Sequence
from astrai.infer.state import init_engine
from astrai.infer.stats import engine_stats
from astrai.infer.step import run_requests


@pytest.fixture(scope="module")
def target():
    return make_model("gqa", seed=0)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, target):
    """Draft folders: the target itself (it accepts everything: long runs are kept) and
    another tiny model with the same vocabulary (it is mostly rejected)."""
    root = tmp_path_factory.mktemp("drafts")
    other = make_model("gqa", seed=1)
    for name, (params, cfg) in {"self": target, "other": other}.items():
        ai.save_pretrained(root / name, params, cfg)
    return {name: str(root / name) for name in ("self", "other")}


@pytest.fixture
def always_verify(monkeypatch):
    """Verify whatever is proposed, so the tests exercise speculation in every step rather
    than only where it pays."""
    monkeypatch.setattr(speculate_step, "worth_verifying", lambda *a: True)
    monkeypatch.setattr(speculate_step, "RATE_FLOOR", 0.0)  # no row watches or pauses
    monkeypatch.setattr(speculate_step, "RATE_RESUME", 0.0)


def _prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts of 1 to 60 tokens, most of them repeating a short pattern (so lookup finds
    matches) with some noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pattern = [rng.randrange(300) for _ in range(rng.randrange(1, 9))]
        tokens = (pattern * 60)[: rng.randrange(1, 61)]
        out.append([t if rng.random() > 0.1 else rng.randrange(300) for t in tokens])
    return out


def _requests(prompts: list[list[int]], seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            str(i),
            p,
            SamplingParams(
                max_tokens=rng.randrange(1, 13),
                temperature=0.0,
                # a stop token some requests meet inside an accepted run
                stop_token_ids=[rng.randrange(300)] if rng.random() < 0.3 else [],
            ),
        )
        for i, p in enumerate(prompts)
    ]


def _outputs(params, cfg, requests, **settings):
    state = init_engine(params, cfg, None, **settings)
    state, completions = run_requests(state, params, requests)
    stats = engine_stats(state)
    assert stats.pages_used == 0 and stats.running == 0
    return [c.token_ids for c in completions], [c.finish_reason for c in completions], stats


# (speculation settings, engine settings, prompts): batch 1 and batched, prefix cache on and
# off, a pool small enough to preempt; 560 prompts in all
CASES = [
    ("lookup", dict(max_batch=1), 60),
    ("lookup", dict(max_batch=8, prefix_cache=False), 100),
    ("lookup", dict(max_batch=8, page_size=4, num_pages=40), 100),
    ("self", dict(max_batch=1, speculative_k=3), 50),
    ("self", dict(max_batch=8, page_size=4, num_pages=40), 100),
    ("other", dict(max_batch=8, prefix_cache=False, speculative_k=2), 50),
    ("other", dict(max_batch=6, page_size=4, num_pages=30), 100),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_greedy_output_is_plain_decodings(case, target, drafts, always_verify):
    kind, settings, n = CASES[case]
    params, cfg = target
    requests = _requests(_prompts(case, n), case)
    spec = dict(speculative="lookup", lookup_ngram=3)
    if kind != "lookup":
        spec = dict(speculative="draft", draft_model=drafts[kind])
    plain, plain_reasons, _ = _outputs(params, cfg, requests, **settings)
    fast, fast_reasons, stats = _outputs(params, cfg, requests, **settings, **spec)
    assert fast == plain
    assert fast_reasons == plain_reasons
    assert stats.spec_proposed > 0 and stats.spec_steps > 0
    if kind == "self":  # the target as its own draft: everything proposed is kept
        assert stats.spec_accepted == stats.spec_proposed
    if "num_pages" in settings:
        assert stats.preemptions > 0


def test_draft_with_another_vocabulary_is_refused(target, tmp_path):
    params, cfg = target
    small_cfg = msgspec.structs.replace(cfg, vocab_size=200)
    ai.save_pretrained(tmp_path, ai.init_params(small_cfg, seed=0), small_cfg)
    with pytest.raises(ValueError, match="draft_model: its vocabulary has 200 tokens"):
        init_engine(params, cfg, None, speculative="draft", draft_model=str(tmp_path))


def test_the_draft_is_prepared_for_decoding(target, drafts):
    # its sibling projections fused and laid out as prepare_params lays out the target's
    params, cfg = target
    state = init_engine(params, cfg, None, speculative="draft", draft_model=drafts["other"])
    draft = state.spec.draft.params
    assert "model.layers.0.self_attn.qkv_proj.weight" in draft
    assert "model.layers.0.self_attn.q_proj.weight" not in draft


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(speculative="draft"), "needs draft_model"),
        (dict(draft_model="x"), 'only used with speculative = "draft"'),
        (dict(speculative="lookup", speculative_k=0), "speculative_k must be positive"),
        (dict(speculative="lookup", lookup_ngram=0), "lookup_ngram must be positive"),
    ],
)
def test_bad_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_speculation_pays_only_when_expected_tokens_cover_the_cost():
    spec = speculate_step.Speculator("lookup", 4, 3)
    seqs = [Sequence(str(i), [1], 1) for i in range(16)]
    for seq in seqs:
        spec.rows[seq.id] = speculate_step.RowSpec(rate=0.5)
    # one row alone: 2 expected tokens against 0.7 of a step
    assert speculate_step.worth_verifying(spec, seqs[:1], [4])
    # 16 rows, 2 proposing: 4 expected tokens against 16 x 0.7
    assert not speculate_step.worth_verifying(spec, seqs, [4] * 2 + [0] * 14)
    assert speculate_step.worth_verifying(spec, seqs, [4] * 16)
    assert not speculate_step.worth_verifying(spec, seqs, [0] * 16)


def test_a_row_that_keeps_little_pauses_then_tries_again():
    row = speculate_step.RowSpec()
    for _ in range(4):
        row = speculate_step.update_rate(row, 4, 0)
        if row.pause:
            break
    assert row.pause == speculate_step.PAUSE_MIN and row.backoff == 2 * row.pause
    row.pause = 0  # the retry: one more failure pauses it again, twice as long
    row = speculate_step.update_rate(row, 4, 0)
    assert row.pause == 2 * speculate_step.PAUSE_MIN
    row.pause = 0  # a retry that keeps its proposal goes on
    row = speculate_step.update_rate(row, 4, 4)
    assert row.pause == 0 and row.rate > speculate_step.RATE_FLOOR
    good = speculate_step.update_rate(speculate_step.RowSpec(), 4, 4)
    assert good.pause == 0 and good.rate > speculate_step.RATE_START


def _text_requests() -> list[Request]:
    text = "hello world, the quick brown fox jumps over the lazy dog. " * 2
    greedy = dict(temperature=0.0, max_tokens=24)
    return [
        Request("stop", text, SamplingParams(**greedy, stop=["hehe", "lazy"])),
        Request("logprobs", text, SamplingParams(**greedy, logprobs=True, top_logprobs=3)),
        Request("penalty", text, SamplingParams(**greedy, repetition_penalty=1.3)),
        Request("bias", text, SamplingParams(**greedy, logit_bias={7: 4.0, 9: -3.0})),
        Request("grammar", text, SamplingParams(**greedy, constraint=regex(r"[a-z ]{4,30}\."))),
        Request("seeded", text, SamplingParams(max_tokens=24, temperature=0.0, seed=5)),
    ]


@pytest.mark.parametrize("kind", ["lookup", "self"])
def test_stops_logprobs_penalties_and_grammar_match_plain_decoding(
    kind, target, drafts, tokenizer, always_verify
):
    params, cfg = target
    spec = dict(speculative="lookup")
    if kind != "lookup":
        spec = dict(speculative="draft", draft_model=drafts[kind])
    results = []
    for settings in ({}, spec):
        state = init_engine(params, cfg, tokenizer, max_batch=4, **settings)
        state, completions = run_requests(state, params, _text_requests())
        results.append(completions)
    assert engine_stats(state).spec_accepted > 0
    assert results[0][0].stop_reason_text == "hehe"  # a stop string ends a run
    for plain, fast in zip(*results):
        assert fast.token_ids == plain.token_ids, fast.request_id
        assert (fast.text, fast.finish_reason, fast.stop_reason_text) == (
            plain.text,
            plain.finish_reason,
            plain.stop_reason_text,
        )
        if plain.logprobs is not None:
            roundings = forward_roundings(cfg, len(plain.token_ids) + 120)
            for a, b in zip(fast.logprobs, plain.logprobs):
                assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
                assert a.logprob == approx(b.logprob, roundings)


def test_the_threaded_engine_speculates_and_counts_it(target, drafts, always_verify):
    params, cfg = target
    prompts = _prompts(99, 6)
    with ai.Engine(params, cfg, None, max_batch=4) as engine:
        plain = [c.token_ids for c in engine.generate(prompts, max_tokens=10, temperature=0)]
    spec = dict(speculative="draft", draft_model=drafts["self"])
    with ai.Engine(params, cfg, None, max_batch=4, **spec) as engine:
        fast = [c.token_ids for c in engine.generate(prompts, max_tokens=10, temperature=0)]
        stats = engine.stats()
    assert fast == plain
    assert 0 < stats.spec_accepted == stats.spec_proposed and stats.spec_steps > 0


def test_a_draft_skipping_steps_stays_in_step_with_the_target(target, drafts, monkeypatch):
    """Steps whose proposals are not worth verifying decode plainly (in decode runs of several
    tokens); the draft, which fed its own guesses in them, rolls back, so the target as its
    own draft still proposes from the target's distribution and every token is kept (p = q),
    sampled requests included."""
    params, cfg = target
    verdicts = iter([True, False] * 1000)
    monkeypatch.setattr(speculate_step, "worth_verifying", lambda *a: next(verdicts))
    requests = [
        Request(str(i), p, SamplingParams(max_tokens=16, temperature=0.8, seed=i))
        for i, p in enumerate(_prompts(5, 12))
    ]
    spec = dict(speculative="draft", draft_model=drafts["self"])
    _, _, stats = _outputs(params, cfg, requests, max_batch=4, **spec)
    assert 0 < stats.spec_accepted == stats.spec_proposed
