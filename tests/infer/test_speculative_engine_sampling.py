"""Sampled output with speculation in the engine keeps the target's distribution: a
chi-square test of the second token's frequencies over many seeds against the exact
distribution, which fails for a wrong acceptance rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from infer_models import make_model
from scipy.stats import chisquare

import astrai as ai
from astrai.infer import speculate_step
from astrai.infer.acceptance import Verdict, request_logits, request_probs
from astrai.infer.requests import Request
from astrai.infer.sampling import SamplingParams
from astrai.infer.state import init_engine
from astrai.infer.stats import engine_stats
from astrai.infer.step import run_requests

SP = SamplingParams(max_tokens=3, temperature=0.8, top_k=40)
SAMPLES = 1500


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The target, a draft folder (another tiny model), a prompt that holds most of the
    likely first tokens (so lookup proposes after them) and the exact distribution of the
    second token."""
    params, cfg = make_model("gqa", seed=0)
    draft = tmp_path_factory.mktemp("draft")
    ai.save_pretrained(draft, *make_model("gqa", seed=1))
    tail, prompt, seen = [1, 2, 3], [1, 2, 3], []
    for _ in range(5):  # every first token possible so far, then the same tail
        probs = _probs(ai.forward(params, cfg, torch.tensor([prompt]))[0, -1:], prompt)[0]
        seen += [t for t in probs.topk(SP.top_k).indices.tolist() if t not in seen]
        prompt = seen + tail
    probs = _probs(ai.forward(params, cfg, torch.tensor([prompt]))[0, -1:], prompt)[0]
    firsts = torch.nonzero(probs > 0).flatten().tolist()
    batch = torch.tensor([[*prompt, t] for t in firsts])
    seconds = ai.forward(params, cfg, batch)[:, -1]
    exact = sum(
        probs[t] * _probs(seconds[i : i + 1], [*prompt, t])[0] for i, t in enumerate(firsts)
    )
    covered = float(sum(probs[t] for t in firsts if t in prompt[:-1]))
    assert covered > 0.5, "the test needs lookup to propose for most first tokens"
    return params, cfg, str(draft), prompt, exact.double().numpy()


def _probs(logits, history):
    p = request_probs(request_logits(logits.float(), SP, history), SP)
    return p / p.sum(-1, keepdim=True)


@pytest.fixture
def always_verify(monkeypatch):
    monkeypatch.setattr(speculate_step, "worth_verifying", lambda *a: True)
    monkeypatch.setattr(speculate_step, "RATE_FLOOR", 0.0)  # no row watches or pauses
    monkeypatch.setattr(speculate_step, "RATE_RESUME", 0.0)


def _second_tokens(params, cfg, prompt, **settings):
    state = init_engine(params, cfg, None, max_batch=256, num_pages=1024, **settings)
    requests = [
        Request(str(i), prompt, ai.infer.sampling.with_fields(SP, {"seed": i}))
        for i in range(SAMPLES)
    ]
    state, completions = run_requests(state, params, requests)
    assert engine_stats(state).spec_proposed > SAMPLES // 2
    return np.bincount([c.token_ids[1] for c in completions], minlength=cfg.vocab_size)


def _p_value(counts: np.ndarray, exact: np.ndarray) -> float:
    """Chi-square over the tokens expected at least 5 times, the rest in one bin (a token
    the target never gives makes the p-value 0)."""
    expected = exact * counts.sum()
    big = expected >= 5
    if (counts[exact == 0] > 0).any():
        return 0.0
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


@pytest.mark.parametrize("proposer", ["lookup", "draft"])
def test_second_token_has_the_targets_distribution(setup, always_verify, proposer):
    params, cfg, draft, prompt, exact = setup
    spec = dict(speculative="lookup", lookup_ngram=1)
    if proposer == "draft":
        spec = dict(speculative="draft", draft_model=draft, speculative_k=1)
    counts = _second_tokens(params, cfg, prompt, **spec)
    assert _p_value(counts, exact) > 1e-3


def test_accepting_every_proposal_fails_the_test(setup, always_verify, monkeypatch):
    """The same test catches a wrong rule: keeping every proposed token."""
    params, cfg, _, prompt, exact = setup

    def accept_all(logits, proposal, sp, generator, history, allowed=None):
        return Verdict([*proposal.tokens, int(logits[-1].argmax())], len(proposal.tokens))

    monkeypatch.setattr(speculate_step, "verify_sampled", accept_all)
    counts = _second_tokens(params, cfg, prompt, speculative="lookup", lookup_ngram=1)
    assert _p_value(counts, exact) < 1e-6
