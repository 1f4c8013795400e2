"""sample: greedy, reproducible seeds, batch independence and the filters' invariants."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from numerics import assert_close

from astrai.infer import SamplingParams, sample, token_logprobs
from astrai.infer.sampling import sampling_params


def random_logits(batch=4, vocab=50, seed=0):
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def generators(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_temperature_zero_is_argmax():
    logits = random_logits()
    assert torch.equal(sample(logits, temperature=0.0), logits.argmax(-1))
    mixed = sample(logits, generators([1, 2, 3, 4]), temperature=torch.tensor([0.0, 1, 0, 1]))
    assert mixed[0] == logits[0].argmax() and mixed[2] == logits[2].argmax()


def test_same_seed_same_tokens_whatever_the_batch():
    logits = random_logits(batch=3)
    alone = [sample(logits[i : i + 1], generators([7])) for i in range(3)]
    batched = sample(logits, generators([7, 7, 7]))
    assert batched.tolist() == [int(a) for a in alone]
    again = sample(logits, generators([7, 7, 7]))
    assert torch.equal(batched, again)


def test_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).repeat(4000, 1)
    ids = sample(logits, torch.Generator().manual_seed(0))
    freq = torch.bincount(ids, minlength=3).float() / len(ids)
    # Sampling noise, not rounding: 4000 seeded draws have a standard error of at most
    # sqrt(0.25 / 4000) = 0.008 per frequency; 0.03 is almost four of them.
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.03, rtol=0)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 1000),
    top_k=st.integers(0, 10),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.9),
)
def test_filters_only_keep_allowed_tokens(seed, top_k, top_p, min_p):
    logits = random_logits(batch=2, vocab=20, seed=seed)
    ids = sample(logits, generators([seed, seed + 1]), top_k=top_k, top_p=top_p, min_p=min_p)
    probs = logits.softmax(-1)
    for row, token in enumerate(ids.tolist()):
        ranked = probs[row].argsort(descending=True).tolist()
        rank = ranked.index(token)
        if top_k:
            assert rank < top_k
        # the tokens more likely than the chosen one hold less than top_p of the mass
        assert probs[row, ranked[:rank]].sum() < top_p + 1e-6
        if top_k == 0 and min_p > 0:
            assert probs[row, token] >= min_p * probs[row].max() - 1e-6


def test_per_row_settings():
    logits = random_logits(batch=2, vocab=30)
    ids = sample(logits, generators([0, 0]), top_k=torch.tensor([1, 0]))
    assert ids[0] == logits[0].argmax()


def test_penalties_and_bias():
    logits = torch.tensor([[0.5, 0.5, 1.0, 0.5, 0.5]])
    recent = torch.tensor([[2, 2, -1]])
    # a strong presence penalty moves greedy away from the repeated token
    assert sample(logits, temperature=0.0, presence_penalty=2.0, recent_tokens=recent) != 2
    assert sample(logits, temperature=0.0, frequency_penalty=0.6, recent_tokens=recent) != 2
    assert sample(logits, temperature=0.0, repetition_penalty=1e3, recent_tokens=recent) != 2
    bias = torch.zeros(1, 5)
    bias[0, 4] = 10.0
    assert sample(logits, temperature=0.0, logit_bias=bias) == 4


def test_logprobs_are_log_softmax_of_raw_logits():
    logits = random_logits()
    ids = logits.argmax(-1)
    chosen, top_ids, top_lp = token_logprobs(logits, ids, top_n=3)
    expected = logits.log_softmax(-1)
    # log_softmax sums exponentials over the vocabulary of 50
    assert_close(chosen, expected.gather(1, ids[:, None])[:, 0], 50)
    assert torch.equal(top_ids[:, 0], ids)
    assert_close(top_lp, expected.topk(3).values, 50)


def test_sampling_params_validate():
    assert sampling_params(max_tokens=5, stop=["x"]) == SamplingParams(max_tokens=5, stop=["x"])
    with pytest.raises(ValueError, match="top_p"):
        sampling_params(top_p=0.0)
    with pytest.raises(ValueError, match="temperture"):
        sampling_params(temperture=0.5)
    with pytest.raises(ValueError, match="max_tokens"):
        sampling_params(max_tokens="many")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.sampled_from([1, 8, 11]),  # 8 rows and up take the blocks
    blocks=st.sampled_from([1, 8, 9, 250]),
    extra=st.sampled_from([0, 0, 37]),
    ties=st.integers(0, 3),
    special=st.sampled_from([None, float("-inf"), float("inf"), float("nan")]),
    seed=st.integers(0, 2**16),
)
def test_argmax_rows_is_argmax(rows, blocks, extra, ties, special, seed):
    # the argmax greedy decoding uses (float32: our kernel, also on rows of a wider tensor;
    # bfloat16: the blocked one): the same first index as torch.argmax, also with tied maxima,
    # rows of -inf, inf and NaN, and vocabularies the blocked one hands back to argmax
    from astrai.infer.sampling import argmax_rows

    g = torch.Generator().manual_seed(seed)
    vocab = blocks * 128 + extra
    logits = torch.randn(rows, vocab, generator=g).round(decimals=1)  # rounding makes ties
    for _ in range(ties):
        logits[:, int(torch.randint(vocab, (), generator=g))] = logits.max() + 1
    if special is not None:
        logits[0, int(torch.randint(vocab, (), generator=g))] = special
        logits[-1] = float("-inf")
    wider = torch.cat([logits, logits], dim=1)[:, :vocab]
    for each in (logits, logits.bfloat16(), wider):
        assert torch.equal(argmax_rows(each), each.argmax(-1))


GREEDY_ROWS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, presence_penalty=2.0),
    SamplingParams(temperature=0.0, logit_bias={4: 10.0}),
    SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
]


@pytest.mark.parametrize("others", [[], [1], [2], [3], [1, 2, 3]])
def test_greedy_requests_take_what_sample_gives(others):
    # plain greedy rows skip sample()'s stages; next to rows that need them, every row goes
    # through sample(): each row's token is what sample gives it alone
    from astrai.infer.sampling import sample_requests

    settings_ = [GREEDY_ROWS[0], *(GREEDY_ROWS[i] for i in others)]
    logits = torch.tensor([[0.5, 0.5, 1.0, 0.5, 0.5]]).repeat(len(settings_), 1)
    histories = [[2, 2]] * len(settings_)
    out = sample_requests(logits, settings_, [None] * len(settings_), histories)
    for row, (sp, (token, logprob)) in enumerate(zip(settings_, out)):
        bias = torch.zeros(1, 5)
        for t, value in (sp.logit_bias or {}).items():
            bias[0, t] = value
        alone = sample(
            logits[row : row + 1],
            temperature=0.0,
            presence_penalty=sp.presence_penalty,
            recent_tokens=torch.tensor([histories[row]]),
            logit_bias=bias,
        )
        assert token == int(alone)
        assert (logprob is not None) == sp.logprobs
    allowed = torch.tensor([[True, False, False, True, False]]).repeat(len(settings_), 1)
    out = sample_requests(logits, settings_, [None] * len(settings_), histories, allowed)
    assert out[0][0] == 0  # the grammar's mask is applied to plain greedy rows as well


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_grammar_still_gets_an_allowed_token_under_huge_penalties(temperature):
    # repetition_penalty 1e308 is inf in float32: the one allowed token, seen before, goes to
    # -inf (or NaN at a logit of 0), and the pick must still be the token the grammar allows
    logits = torch.tensor([[-0.5, 0.0, 2.0, 1.0]])
    allowed = torch.tensor([[True, False, False, False]])
    for penalty in (dict(repetition_penalty=1e308), dict(frequency_penalty=1e308)):
        token = sample(
            logits, temperature=temperature, recent_tokens=torch.tensor([[0, 1]]),
            allowed=allowed, **penalty,
        )  # fmt: skip
        assert int(token) == 0
    bias = torch.tensor([[float("-inf"), 0.0, 0.0, 0.0]])
    assert int(sample(logits, temperature=temperature, logit_bias=bias, allowed=allowed)) == 0


def test_a_tiny_top_p_keeps_the_most_likely_allowed_token():
    # 1e-58 is 0 in float32: every token's mass "before" it reaches it, the first included
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5]])
    for allowed in (None, torch.tensor([[False, True, True, False]])):
        best = 0 if allowed is None else 1
        for seed in range(5):
            g = torch.Generator().manual_seed(seed)
            assert int(sample(logits, g, top_p=1e-58, allowed=allowed)) == best


def test_with_fields_replaces_the_named_fields_and_checks_them():
    from astrai.infer.constraints import Constraint
    from astrai.infer.sampling import with_fields

    base = SamplingParams(max_tokens=5, stop=["x"], constraint=Constraint("start: /[ab]+/"))
    assert with_fields(base, {}) is base
    assert with_fields(None, {}) == SamplingParams()
    assert with_fields(base, {"temperature": 0.0}) == SamplingParams(
        max_tokens=5, stop=["x"], constraint=Constraint("start: /[ab]+/"), temperature=0.0
    )
    with pytest.raises(ValueError, match="temperture"):
        with_fields(base, {"temperture": 0.5})
