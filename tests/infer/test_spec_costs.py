"""The speculation gate with step costs measured as the engine runs (spec_costs.py): the prior
until measured, a cheap verify step lets a step verify, a dear one stops it; an engine given a
clock measures its steps and keeps its output exact."""

from __future__ import annotations

import pytest
from infer_models import make_model
from spec_rows import rows_at_rate

import astrai as ai
from astrai.infer import spec_costs, speculate_step
from astrai.infer.requests import Request
from astrai.infer.sampling import SamplingParams
from astrai.infer.spec_costs import StepCosts, verify_cost, with_decode, with_verify
from astrai.infer.state import add_request, init_engine
from astrai.infer.step import engine_step, run_requests


def _measured(rows: int, k: int, decode: float, verify: float, times: int = 12) -> StepCosts:
    """Costs after `times` decode and verify steps of these seconds (the first of each is a
    warm-up)."""
    costs = StepCosts()
    for _ in range(times):
        costs = with_decode(costs, rows, decode)
        costs = with_verify(costs, rows, k, verify)
    return costs


def test_buckets_are_powers_of_two():
    assert [spec_costs.size_bucket(n) for n in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]
    with pytest.raises(ValueError, match="rows"):
        spec_costs.size_bucket(0)


def test_the_prior_until_measured_then_the_measured_share():
    costs = StepCosts()
    assert verify_cost(costs, 1, 4) == pytest.approx(0.7)
    costs = with_decode(costs, 1, 0.010)  # the first step of a shape is a warm-up
    assert costs.decode == {}
    costs = with_verify(with_decode(costs, 1, 0.010), 1, 4, 0.5)
    assert verify_cost(costs, 1, 4) == pytest.approx(0.7)  # the verify's warm-up
    costs = with_verify(costs, 1, 4, 0.030)  # 3x a decode step: 2.0 beyond it
    assert verify_cost(costs, 1, 4) == pytest.approx(0.7 + spec_costs.COST_WEIGHT * (2.0 - 0.7))
    costs = _measured(1, 4, 0.010, 0.030, times=60)
    assert verify_cost(costs, 1, 4) == pytest.approx(2.0, rel=1e-3)
    # other batch sizes and k keep their own (here still the prior)
    assert verify_cost(costs, 16, 4) == pytest.approx(0.7)
    assert verify_cost(costs, 1, 2) == pytest.approx(0.5)
    assert verify_cost(costs, 1, 0) == 0.0


def test_a_verify_before_any_decode_step_is_not_a_measurement():
    costs = with_verify(with_verify(StepCosts(), 16, 4, 0.1), 16, 4, 0.1)
    assert costs.verify == {}


def test_a_cheap_verify_lets_a_step_verify_and_a_dear_one_stops_it():
    spec = speculate_step.Speculator("lookup", 4, 3)
    seqs = rows_at_rate(spec, 16, 0.15)
    # 0.15 x 4 = 0.6 expected tokens a row: below the prior's 0.7
    assert not speculate_step.worth_verifying(spec, seqs[:1], [4])
    spec.costs = _measured(1, 4, decode=0.010, verify=0.0105)  # 0.05 beyond a decode step
    assert speculate_step.worth_verifying(spec, seqs[:1], [4])
    for row in spec.rows.values():
        row.rate = 0.4  # 1.6 a row: above the prior's 0.7 ...
    assert speculate_step.worth_verifying(spec, seqs, [4] * 16)
    spec.costs = _measured(16, 4, decode=0.010, verify=0.028)  # ... below a measured 1.8
    assert not speculate_step.worth_verifying(spec, seqs, [4] * 16)
    assert speculate_step.worth_verifying(spec, seqs[:1], [4])  # batch 1 is still the prior


class _Clock:
    """A fake clock that moves by `tick` seconds at every reading."""

    def __init__(self, tick: float):
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _requests() -> list[Request]:
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, [3, 4] * 10]
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [Request(str(i), p, sampling) for i, p in enumerate(prompts)]


def _run_with_clock(state, params, requests):
    """Every request to its end through engine_step with a fake clock -> (state, tokens)."""
    for request in requests:
        state = add_request(state, request)
    clock, tokens = _Clock(0.001), {r.id: [] for r in requests}
    while state.sched.running or state.sched.waiting:
        state, events = engine_step(state, params, clock=clock)
        for event in events:
            tokens[event.request_id] += event.token_ids
    return state, [tokens[r.id] for r in requests]


@pytest.fixture(scope="module")
def target():
    return make_model("gqa", seed=0)


def test_an_engine_with_a_clock_times_its_plain_decode_steps(target):
    """A random tiny model's output does not repeat its prompt: lookup rarely proposes, and
    the plain decode steps (runs of them) are timed per bucket."""
    params, cfg = target
    _, plain = run_requests(init_engine(params, cfg, None), params, _requests())
    state = init_engine(params, cfg, None, speculative="lookup", speculative_k=4)
    state, tokens = _run_with_clock(state, params, _requests())
    assert tokens == [c.token_ids for c in plain]
    decode = state.spec.costs.decode
    assert decode and all(seconds > 0 for seconds in decode.values())


def test_an_engine_with_a_clock_times_its_verify_steps_and_stays_exact(target, tmp_path):
    """The target drafts for itself (every proposal kept), its draft steps counted free: the
    engine verifies in every step, each timed by the clock given, and writes plain decoding's
    tokens."""
    params, cfg = target
    ai.save_pretrained(tmp_path / "draft", params, cfg)
    _, plain = run_requests(init_engine(params, cfg, None), params, _requests())
    draft = str(tmp_path / "draft")
    state = init_engine(params, cfg, None, speculative="draft", draft_model=draft)
    state.spec.draft_cost = 0.0
    state, tokens = _run_with_clock(state, params, _requests())
    assert tokens == [c.token_ids for c in plain]
    assert state.totals.spec_steps > 0
    assert any(key[0] == "verify" for key in state.spec.costs.seen)
    assert any(key[0] == "draft" for key in state.spec.costs.seen)  # its steps too


def test_a_drafts_measured_steps_replace_its_weights_share():
    spec = speculate_step.Speculator("draft", 4, 3, draft_cost=0.04)
    seqs = rows_at_rate(spec, 1, 0.5)
    # 2 expected tokens against the prior 0.7 + 4 x 0.04
    assert speculate_step.worth_verifying(spec, seqs, [4])
    costs = StepCosts()
    for _ in range(12):  # a draft step at half a target step: 0.7 + 4 x 0.5 = 2.7
        costs = spec_costs.with_draft(with_decode(costs, 1, 0.010), 1, 0.005)
    spec.costs = costs
    assert spec_costs.draft_cost(costs, 1, 0.04) == pytest.approx(0.5)
    assert spec_costs.draft_cost(costs, 16, 0.04) == 0.04  # not measured at 16 rows
    assert not speculate_step.worth_verifying(spec, seqs, [4])
