"""Speculation under sampling draws each token from the distribution plain sampling would:
a chi-square test of whole 3-token continuations over many seeds, on a 4-token vocabulary,
against the exact distribution that `sample`'s stages give the target's logits. The same test
rejects two wrong acceptance rules, so it has the power to see a bias."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from infer_models import BASE

import astrai as ai
from astrai.infer import init_pages
from astrai.infer.acceptance import Verdict, request_logits, request_probs, verify_sampled
from astrai.infer.draft import init_draft
from astrai.infer.lookup import init_lookup, propose_lookup
from astrai.infer.proposal import Proposal
from astrai.infer.sampling import SamplingParams, adjusted_logits, draw, probabilities, sample_ids
from astrai.infer.speculative_loop import speculative_generate

V, NEW, K = 4, 3, 2
CFG = ai.ModelConfig(**{**BASE, "vocab_size": V})
PROMPT = [0, 1, 2, 3, 1, 2, 0, 1]
SETTINGS = {
    "plain": SamplingParams(temperature=1.0),
    "filtered": SamplingParams(
        temperature=0.7,
        top_k=3,
        top_p=0.9,
        repetition_penalty=1.5,
        presence_penalty=0.3,
        penalty_window=3,
    ),
}


def logits_table(params) -> dict[tuple[int, ...], torch.Tensor]:
    """The model's next-token logits after the prompt and every continuation of up to NEW - 1
    tokens: a verification reads its k + 1 rows from here (the paged forward that computes
    them is tested against `forward` in test_speculative_greedy.py)."""
    table = {}
    with torch.no_grad():
        for n in range(NEW):
            for tail in itertools.product(range(V), repeat=n):
                context = (*PROMPT, *tail)
                table[context] = ai.forward(params, CFG, torch.tensor([context]))[0, -1]
    return table


def exact(table, sp: SamplingParams) -> torch.Tensor:
    """P(x1, x2, x3) of plain sampling, [V ** NEW], from sample's own stages."""
    out = torch.empty(V**NEW, dtype=torch.float64)
    for cell, tail in enumerate(itertools.product(range(V), repeat=NEW)):
        p = 1.0
        for j in range(NEW):
            context = (*PROMPT, *tail[:j])
            window = list(context[-sp.penalty_window :]) if sp.has_penalties else None
            logits = adjusted_logits(
                table[context][None],
                repetition_penalty=sp.repetition_penalty,
                frequency_penalty=sp.frequency_penalty,
                presence_penalty=sp.presence_penalty,
                recent_tokens=None if window is None else torch.tensor([window]),
            )
            probs = probabilities(
                logits, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p
            )[0].double()
            p *= float(probs[tail[j]] / probs.sum())
        out[cell] = p
    return out


def accept_always(logits, proposal, sp, generator, history):
    probs = request_probs(request_logits(logits, sp, history, proposal.tokens), sp)
    return Verdict([*proposal.tokens, int(draw(probs[-1:], [generator]))], len(proposal.tokens))


def resample_from_p(logits, proposal, sp, generator, history):
    """Accepts with min(1, p/q) but redraws a rejected token from p instead of max(0, p - q)."""
    tokens, q = proposal
    probs = request_probs(request_logits(logits, sp, history, tokens), sp)
    p = probs / probs.sum(-1, keepdim=True)
    for j, d in enumerate(tokens):
        q_d = 1.0 if q is None else float(q[j, d])
        if float(torch.rand((), generator=generator)) * q_d >= float(p[j, d]):
            return Verdict([*tokens[:j], int(draw(p[j : j + 1], [generator]))], j)
    return Verdict([*tokens, int(draw(p[-1:], [generator]))], len(tokens))


def propose(kind, draft_table, tokens, room, sp, generator) -> Proposal:
    if kind == "lookup":  # one-hot q
        return Proposal(propose_lookup(init_lookup(tokens, 1, 2), room))
    drafted, rows = [], []  # a draft model sampled with the request's settings
    for _ in range(room):
        context = (*tokens, *drafted)
        probs = request_probs(request_logits(draft_table[context][None], sp, list(context)), sp)
        drafted.append(int(draw(probs, [generator])))
        rows.append((probs / probs.sum())[0])
    return Proposal(drafted, torch.stack(rows) if rows else None)


def continuation(rule, kind, target, draft, sp, seed) -> int:
    """NEW tokens by speculation from seed; their cell index."""
    generator = torch.Generator().manual_seed(seed)
    draft_generator = torch.Generator().manual_seed(seed + 10**6)
    tokens = list(PROMPT)
    while len(tokens) < len(PROMPT) + NEW:
        room = min(K, len(PROMPT) + NEW - len(tokens) - 1)
        proposal = propose(kind, draft, tokens, room, sp, draft_generator)
        rows = [target[(*tokens, *proposal.tokens[:j])] for j in range(len(proposal.tokens) + 1)]
        tokens += rule(torch.stack(rows), proposal, sp, generator, tokens).tokens
    return sum(t * V ** (NEW - 1 - i) for i, t in enumerate(tokens[len(PROMPT) :]))


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value; cells expecting fewer than 5 are pooled."""
    n = float(counts.sum())
    expected = expected_probs * n
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), torch.tensor(stat / 2)))


SEEDS = 4000  # the loop test runs a quarter: each of its runs is a paged forward or three
ALPHA = 1e-3  # the seeds are fixed, so each case passes or fails the same way every run


@pytest.fixture(scope="module")
def tables():
    return logits_table(ai.init_params(CFG, seed=0)), logits_table(ai.init_params(CFG, seed=5))


def counts_of(rule, kind, sp, tables) -> torch.Tensor:
    target, draft = tables
    cells = [continuation(rule, kind, target, draft, sp, seed) for seed in range(SEEDS)]
    return torch.bincount(torch.tensor(cells), minlength=V**NEW)


@pytest.mark.parametrize("kind", ["lookup", "draft"])
@pytest.mark.parametrize("settings", list(SETTINGS))
def test_speculation_samples_the_plain_distribution(kind, settings, tables):
    sp = SETTINGS[settings]
    assert chi_square_p(counts_of(verify_sampled, kind, sp, tables), exact(tables[0], sp)) > ALPHA


@pytest.mark.parametrize("rule", [accept_always, resample_from_p])
@pytest.mark.parametrize("kind", ["lookup", "draft"])
def test_a_wrong_acceptance_rule_fails_the_same_test(rule, kind, tables):
    sp = SETTINGS["plain"]
    assert chi_square_p(counts_of(rule, kind, sp, tables), exact(tables[0], sp)) < ALPHA


def test_the_test_accepts_plain_sampling(tables):
    """Plain sampling itself, by sample_ids, passes: the exact distribution is sample's."""
    sp = SETTINGS["filtered"]
    target, _ = tables
    cells = []
    for seed in range(SEEDS):
        generator, tokens = torch.Generator().manual_seed(seed), list(PROMPT)
        for _ in range(NEW):
            logits = target[tuple(tokens)][None]
            tokens.append(int(sample_ids(logits, [sp], [generator], [tokens])[0]))
        cells.append(sum(t * V ** (NEW - 1 - i) for i, t in enumerate(tokens[len(PROMPT) :])))
    counts = torch.bincount(torch.tensor(cells), minlength=V**NEW)
    assert chi_square_p(counts, exact(target, sp)) > ALPHA


@pytest.mark.parametrize("settings", list(SETTINGS))
def test_without_proposals_verification_is_sample(settings, tables):
    """Same generator, same stages, same one uniform: the very token `sample_ids` draws
    (equal, not close: both run the same ops on the same inputs)."""
    sp = SETTINGS[settings]
    target, _ = tables
    for seed in range(50):
        logits = target[tuple(PROMPT)][None]
        ours = verify_sampled(logits, Proposal([]), sp, torch.Generator().manual_seed(seed), PROMPT)
        theirs = sample_ids(logits, [sp], [torch.Generator().manual_seed(seed)], [PROMPT])
        assert ours == Verdict([int(theirs[0])], 0)


def test_chi_square_p_value_is_pearsons():
    # 2 cells, 60/40 against 50/50 of 100: stat 4, one degree of freedom, p = erfc(sqrt(2))
    p = chi_square_p(torch.tensor([60, 40]), torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert p == pytest.approx(math.erfc(math.sqrt(2)), rel=1e-5)


@pytest.mark.parametrize(
    "proposal, field",
    [(Proposal([V]), "tokens"), (Proposal([1, 2], torch.full((1, V), 1 / V)), "probs")],
)
def test_a_proposal_that_cannot_be_verified_is_refused(proposal, field, tables):
    logits = torch.zeros(len(proposal.tokens) + 1, V)
    with pytest.raises(ValueError, match=f"Proposal.{field}"):
        verify_sampled(logits, proposal, SETTINGS["plain"], None, PROMPT)


def test_the_loop_with_a_sampled_draft_model_samples_the_plain_distribution(tables):
    """End to end: the paged verification forward, the draft model's own pool and the
    probabilities it reports for the tokens it drew, through speculative_generate."""
    sp = SETTINGS["filtered"]
    target, draft = ai.init_params(CFG, seed=0), ai.init_params(CFG, seed=5)
    pool, state, cells = init_pages(CFG, 8, 4), init_draft(draft, CFG, 8, 4), []
    with torch.no_grad():
        for seed in range(SEEDS // 4):
            tokens, _, pool, state = speculative_generate(
                target,
                CFG,
                pool,
                PROMPT,
                NEW,
                state,
                K,
                sp,
                torch.Generator().manual_seed(seed),
                torch.Generator().manual_seed(seed + 10**6),
            )
            cells.append(sum(t * V ** (NEW - 1 - i) for i, t in enumerate(tokens)))
    counts = torch.bincount(torch.tensor(cells), minlength=V**NEW)
    assert chi_square_p(counts, exact(tables[0], sp)) > ALPHA


@pytest.mark.parametrize("settings", list(SETTINGS))
def test_every_kept_token_is_one_the_grammar_allows(settings):
    """allowed[j] is the grammar's mask after the first j proposed tokens: a proposed token
    it forbids has p = 0 and is never kept, and no corrected or bonus token breaks it."""
    sp = SETTINGS[settings]
    g = torch.Generator().manual_seed(0)
    for seed in range(200):
        logits = torch.randn(K + 1, V, generator=g) * 3
        allowed = torch.rand(K + 1, V, generator=g) < 0.5
        allowed[torch.arange(K + 1), torch.randint(0, V, (K + 1,), generator=g)] = True
        proposed = torch.randint(0, V, (K,), generator=g).tolist()
        generator = torch.Generator().manual_seed(seed)
        verdict = verify_sampled(logits, Proposal(proposed), sp, generator, PROMPT, allowed)
        assert verdict.tokens[: verdict.accepted] == proposed[: verdict.accepted]
        assert all(allowed[j, t] for j, t in enumerate(verdict.tokens))
