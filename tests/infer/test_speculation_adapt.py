"""Speculation's adaptation: the gate counts a draft's own steps, a lookup row below the floor
scores its proposals against what it writes instead of verifying them, new rows start from
the engine's prior, and a draft's last position stops only the row that reaches it."""

from __future__ import annotations

import msgspec
import pytest
from infer_models import make_model
from spec_rows import rows_at_rate

import astrai as ai
from astrai.infer import speculate_step
from astrai.infer.requests import Request
from astrai.infer.sampling import SamplingParams
from astrai.infer.sequence import Sequence
from astrai.infer.state import init_engine
from astrai.infer.stats import engine_stats
from astrai.infer.step import run_requests


@pytest.fixture(scope="module")
def target():
    return make_model("gqa", seed=0)


def test_the_gate_counts_the_drafts_own_steps():
    lookup = speculate_step.Speculator("lookup", 4, 3)
    draft = speculate_step.Speculator("draft", 4, 3, draft_cost=0.25)
    seqs = rows_at_rate(lookup, 16, 0.4)
    rows_at_rate(draft, 16, 0.4)
    # one row, 1.6 expected tokens: lookup pays 0.7 of a step; the draft 0.7 + 4 x 0.25 = 1.7
    assert speculate_step.worth_verifying(lookup, seqs[:1], [4])
    assert not speculate_step.worth_verifying(draft, seqs[:1], [4])
    # 16 rows at 0.4 of 4 tokens, 25.6 expected: against 16 x 0.7 = 11.2, and 16 x 1.7 = 27.2
    assert speculate_step.worth_verifying(lookup, seqs, [4] * 16)
    assert not speculate_step.worth_verifying(draft, seqs, [4] * 16)
    for row in draft.rows.values():
        row.rate = 0.5  # 32 expected tokens pay for the draft too
    assert speculate_step.worth_verifying(draft, seqs, [4] * 16)
    # a shorter proposal costs fewer draft steps: 1 token at 0.5 against 0.4 + 0.25
    assert not speculate_step.worth_verifying(draft, seqs[:1], [1])
    draft.rows["0"].rate = 0.7
    assert speculate_step.worth_verifying(draft, seqs[:1], [1])


def test_a_drafts_step_cost_is_its_share_of_the_weights(target):
    _, cfg = target
    assert speculate_step.draft_step_cost(cfg, cfg) == 1.0
    narrow = msgspec.structs.replace(cfg, hidden_size=16, intermediate_size=32)
    shallow = msgspec.structs.replace(cfg, num_hidden_layers=1)
    assert 0 < speculate_step.draft_step_cost(narrow, cfg) < 0.5
    assert speculate_step.draft_step_cost(shallow, cfg) < 1.0


def test_an_unverified_proposal_is_scored_by_what_the_row_writes():
    row = speculate_step.RowSpec(unverified=(3, [7, 8, 9, 10]))
    assert speculate_step.unverified_outcome(row, [1, 2, 3]) is None  # nothing written yet
    assert speculate_step.unverified_outcome(row, [1, 2, 3, 7, 8, 5, 10]) == (4, 2)
    assert speculate_step.unverified_outcome(row, [1, 2, 3, 6]) == (4, 0)
    # all written ones match: the rest is not known yet, so only they count
    assert speculate_step.unverified_outcome(row, [1, 2, 3, 7, 8]) == (2, 2)
    assert speculate_step.unverified_outcome(speculate_step.RowSpec(), [1, 2]) is None


def test_new_rows_start_from_the_engines_prior():
    for kind in ("lookup", "draft"):
        spec = speculate_step.Speculator(kind, 4, 3)
        assert speculate_step.new_row(spec).rate == speculate_step.RATE_START
        row = speculate_step.RowSpec()
        for _ in range(10):  # ten failures bring the prior under the floor
            spec = speculate_step.learn(spec, row, 4, 0)
        assert spec.prior < speculate_step.RATE_FLOOR
        fresh = speculate_step.new_row(spec)
        if kind == "lookup":  # it watches: proposes, unverified, until its rate is back
            assert fresh.rate < speculate_step.RATE_FLOOR and fresh.pause == 0
        else:  # it waits as long as the engine's rows last paused, then tries once
            assert fresh.pause == spec.backoff and fresh.rate == speculate_step.RATE_FLOOR


def test_on_always_wrong_proposals_later_requests_verify_nothing(target, monkeypatch):
    params, cfg = target
    greedy = SamplingParams(temperature=0.0, max_tokens=40)
    requests = [Request(str(i), [5 + i, 17, 3 * i + 1], greedy) for i in range(4)]
    plain = init_engine(params, cfg, None, max_batch=4)
    plain, expected = run_requests(plain, params, requests)
    wrong = min(set(range(cfg.vocab_size)) - {t for c in expected for t in c.token_ids})
    monkeypatch.setattr(speculate_step, "propose_lookup", lambda index, k: [wrong] * k)
    state = init_engine(params, cfg, None, max_batch=4, speculative="lookup")
    steps = []
    for request, plain_completion in zip(requests, expected):  # one after another
        state, (completion,) = run_requests(state, params, [request])
        assert completion.token_ids == plain_completion.token_ids
        steps.append(engine_stats(state).spec_steps)
    assert 0 < steps[0] <= 3  # the first request learns it: a few failed verifications
    assert steps[-1] == steps[0]  # the others start below the floor and only watch
    stats = engine_stats(state)  # what they watched is counted, none of it kept
    assert stats.spec_watched > 3 * 30 and stats.spec_watched_kept == 0


def test_a_watching_row_verifies_again_once_its_proposals_would_be_kept(target, monkeypatch):
    """A row that fell below the floor on wrong proposals, then proposes what it writes,
    verifies again: the unverified proposals scored against its tokens bring its rate back."""
    params, cfg = target
    greedy = SamplingParams(temperature=0.0, max_tokens=60)
    request = Request("r", [5, 17, 3], greedy)
    plain = init_engine(params, cfg, None, max_batch=4)
    plain, (expected,) = run_requests(plain, params, [request])
    future = list(expected.token_ids)
    wrong = min(set(range(cfg.vocab_size)) - set(future))

    def proposer(index, k):  # wrong for the first 20 tokens, then the target's own
        done = len(index.tokens) - 3
        return [wrong] * k if done < 20 else future[done : done + k]

    monkeypatch.setattr(speculate_step, "propose_lookup", proposer)
    state = init_engine(params, cfg, None, max_batch=4, speculative="lookup")
    state, (got,) = run_requests(state, params, [request])
    stats = engine_stats(state)
    assert got.token_ids == expected.token_ids
    assert stats.spec_accepted > 10  # verified again after watching


def test_a_short_draft_stops_only_the_row_at_its_last_position(target, tmp_path, monkeypatch):
    params, cfg = target
    limit = 24
    ai.save_pretrained(
        tmp_path, params, msgspec.structs.replace(cfg, max_position_embeddings=limit)
    )
    monkeypatch.setattr(speculate_step, "worth_verifying", lambda *a: True)
    monkeypatch.setattr(speculate_step, "RATE_FLOOR", 0.0)  # the target as draft: never pauses
    calls = []
    real = speculate_step.draft_propose_batch

    def recording(state, rids, token_lists, k, *rest):
        state, proposals = real(state, rids, token_lists, k, *rest)
        calls.append({r: (len(t), len(p.tokens)) for r, t, p in zip(rids, token_lists, proposals)})
        return state, proposals

    monkeypatch.setattr(speculate_step, "draft_propose_batch", recording)
    greedy = SamplingParams(temperature=0.0, max_tokens=30)
    requests = [Request("long", list(range(3, 21)), greedy), Request("short", [4, 9], greedy)]
    plain = init_engine(params, cfg, None, max_batch=4)
    plain, expected = run_requests(plain, params, requests)
    state = init_engine(
        params, cfg, None, max_batch=4, speculative="draft", draft_model=str(tmp_path)
    )
    state, got = run_requests(state, params, requests)
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    last = max(i for i, c in enumerate(calls) if "long" in c)
    # the long row proposes up to the draft's last position, then asks no more
    assert all(n + p <= limit for c in calls for n, p in [c.get("long", (0, 0))])
    assert got[0].token_ids and len(requests[0].prompt) + len(got[0].token_ids) > limit
    # the short row goes on with full proposals after the long one stopped
    after = [c["short"] for c in calls[last + 1 :]]
    assert after and all(p == 4 for n, p in after if n + 4 <= limit)
    assert sum(p == 4 for _, p in after) >= 2


def test_a_watching_row_needs_more_than_the_floor_to_verify_again():
    """One lucky scored proposal lifts a watched row over the floor but not to RATE_RESUME; a
    verifying row keeps verifying down to the floor."""
    row = speculate_step.RowSpec(rate=0.1, watching=True)
    row = speculate_step.fold_watched(row, 4, 2)  # 0.1 + 0.3 x (0.5 - 0.1) = 0.22
    assert speculate_step.RATE_FLOOR < row.rate < speculate_step.RATE_RESUME and row.watching
    row = speculate_step.fold_watched(row, 4, 4)  # 0.454
    assert row.rate >= speculate_step.RATE_RESUME and not row.watching
    row = speculate_step.fold_watched(row, 4, 0)  # 0.318: under RATE_RESUME, over the floor
    assert not row.watching
    row = speculate_step.fold_watched(row, 4, 0)  # 0.22
    row = speculate_step.fold_watched(row, 4, 0)  # 0.156: under the floor
    assert row.watching


def test_a_new_lookup_row_watches_unless_the_prior_clears_the_resume_bar():
    spec = speculate_step.Speculator("lookup", 4, 3)
    for prior, watching in [(0.5, False), (0.4, False), (0.3, True), (0.1, True)]:
        spec.prior = prior
        assert speculate_step.new_row(spec).watching == watching, prior


def test_a_closed_batch_of_fixed_lengths_verifies_only_what_shortens_it():
    """With no request waiting and rows that end only at their length, the batch lasts as
    long as its longest row: proposals that do not shorten it save no step."""
    spec = speculate_step.Speculator("lookup", 4, 3)
    seqs = rows_at_rate(spec, 16, 1.0)
    for seq in seqs:
        seq.max_len = 24  # 23 tokens to go each
    few = [4] * 4 + [0] * 12
    assert speculate_step.worth_verifying(spec, seqs, few)  # 16 tokens over 16 rows, > 0.7
    assert not speculate_step.worth_verifying(spec, seqs, few, seqs)
    assert speculate_step.worth_verifying(spec, seqs, [4] * 16, seqs)
    for seq in seqs[4:]:  # the others are ahead: the four proposing rows decide the length
        seq.tokens += [1] * 4
    assert speculate_step.steps_saved(spec, seqs, few, seqs) == 4
    feeding = Sequence("p", [1], 1, max_len=24)  # still feeding its prompt: 23 to go as well
    assert not speculate_step.worth_verifying(spec, seqs[:4], [4] * 4, [*seqs, feeding])
    seqs[5].stop_ids = frozenset({3})  # a row that may stop sooner: no row decides the length
    for seq in seqs[4:]:
        seq.tokens = seq.tokens[:1]
    assert speculate_step.worth_verifying(spec, seqs, few, seqs)


def test_in_a_closed_batch_only_proposals_for_every_row_verify(target, monkeypatch):
    """Two of four rows with proposals the model keeps: the gate's tokens would pay for the
    verify step, but the batch waits for the other two, so with lengths fixed nothing is
    verified; with a stop token that may end any row sooner, they are. Outputs are the same."""
    params, cfg = target

    def spec_steps(sampling, proposing):
        requests = [Request(str(i), [5 + i, 17, 3 * i + 1], sampling) for i in range(4)]
        plain = init_engine(params, cfg, None, max_batch=4)
        _, expected = run_requests(plain, params, requests)
        future = {tuple(r.prompt): c.token_ids for r, c in zip(requests[:proposing], expected)}

        def proposer(index, k):  # the target's own next tokens, for the proposing rows
            done = len(index.tokens) - 3
            return list(future.get(tuple(index.tokens[:3]), [])[done : done + k])

        monkeypatch.setattr(speculate_step, "propose_lookup", proposer)
        state = init_engine(params, cfg, None, max_batch=4, speculative="lookup")
        state, got = run_requests(state, params, requests)
        assert [c.token_ids for c in got] == [c.token_ids for c in expected]
        return engine_stats(state).spec_steps

    fixed = SamplingParams(temperature=0.0, max_tokens=30)
    assert spec_steps(fixed, 2) == 0
    assert spec_steps(fixed, 4) > 0
    may_stop = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[cfg.vocab_size - 1])
    assert spec_steps(may_stop, 2) > 0
