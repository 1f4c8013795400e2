"""plan_step: decoding goes on while long prompts advance in chunks; pages run out gracefully."""

from __future__ import annotations

import astrai as ai
from astrai.config import EngineConfig
from astrai.infer import init_pages, num_free_pages
from astrai.infer.sampling import SamplingParams
from astrai.infer.scheduler import (
    StepPlan,
    add_sequence,
    advance,
    decode_run_length,
    finish_sequence,
    init_scheduler,
    plan_step,
)
from astrai.infer.sequence import Sequence

CFG = ai.ModelConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2)


def scheduler(num_pages=64, page_size=4, max_batch=8, prefill_chunk=16, **settings):
    pool = init_pages(CFG, num_pages, page_size)
    config = EngineConfig(
        page_size=page_size, max_batch=max_batch, prefill_chunk=prefill_chunk, **settings
    )
    return init_scheduler(pool, config)


def ran(s, plan, sample=7):
    """What the engine does after the model ran a plan: advance, and sample where a prompt
    ended. Returns the scheduler."""
    s = advance(s, plan)
    for seq in [*plan.decode, *(seq for seq, _ in plan.prefill)]:
        if seq.pending == 0:
            seq.tokens.append(sample)
    return s


def step(s):
    s, plan = plan_step(s)
    return ran(s, plan), plan


def test_decoding_goes_on_while_a_long_prompt_is_prefilled_in_chunks():
    s = scheduler(prefill_chunk=16)
    short = Sequence("short", [1, 2, 3], 3)
    s = add_sequence(s, short)
    s, _ = step(s)  # the short prompt is prefilled and decoding
    long = Sequence("long", list(range(16)) * 5, 80)
    s = add_sequence(s, long)
    steps = 0
    while long.pending > 1 or not long.computed:
        s, plan = plan_step(s)
        assert plan.decode == [short]  # one token per step for the running stream
        assert [(seq.id, n) for seq, n in plan.prefill] == [("long", min(16, long.pending))]
        s = ran(s, plan)
        steps += 1
    assert steps == 5  # 80 prompt tokens in chunks of 16


def test_padded_prefill_batch_stays_within_the_budget():
    s = scheduler(prefill_chunk=12, max_batch=8)
    for i in range(6):
        s = add_sequence(s, Sequence(f"s{i}", [i] * (3 + i), 3 + i))
    s, plan = plan_step(s)
    width = max(n for _, n in plan.prefill)
    assert len(plan.prefill) * width <= 12
    assert len(s.running) == 6


def test_max_batch_limits_running_sequences():
    s = scheduler(max_batch=2)
    for i in range(4):
        s = add_sequence(s, Sequence(f"s{i}", [1, 2], 2))
    s, _ = plan_step(s)
    assert [seq.id for seq in s.running] == ["s0", "s1"]
    assert len(s.waiting) == 2


def test_out_of_pages_preempts_the_newest_and_frees_its_pages():
    s = scheduler(num_pages=6, page_size=4, prefix_cache=False)
    a, b = Sequence("a", [1] * 8, 8), Sequence("b", [2] * 8, 8)
    s = add_sequence(s, a)
    s = add_sequence(s, b)
    s, _ = step(s)  # both prefilled: 2 pages each, 2 free
    for _ in range(12):
        s, plan = step(s)
        if plan.preempted:
            break
    assert plan.preempted == [b]
    assert b.pages == [] and b.computed == 0 and s.waiting[0] is b
    assert b.tokens[:8] == [2] * 8 and len(b.tokens) > 8  # generated tokens are kept
    s = finish_sequence(s, a)
    s = finish_sequence(s, b)
    assert num_free_pages(s.pool) == 6


def test_admission_counts_the_pages_it_already_promised():
    s = scheduler(num_pages=6, page_size=4, prefix_cache=False)
    s = add_sequence(s, Sequence("a", [1] * 4, 4))
    s, _ = step(s)  # a runs on 1 page; 5 are free
    b, c = Sequence("b", [2] * 12, 12), Sequence("c", [3] * 12, 12)
    s = add_sequence(s, b)
    s = add_sequence(s, c)
    s, plan = plan_step(s)
    # b's prompt takes 3 of the 5; c's 3 more are not there, though 5 are free right now
    # (admitted, c would take pages a needs, and one of them be preempted)
    assert [seq.id for seq in s.running] == ["a", "b"] and list(s.waiting) == [c]
    assert plan.preempted == []


def test_a_prompt_waits_for_the_same_prefix_being_prefilled():
    s = scheduler(prefill_chunk=4)
    a, b, c = (Sequence(x, [1, 2, 3, 4, 5, 6, 7, 8, 9], 9) for x in "abc")
    other = Sequence("other", [9, 9, 9, 9, 9, 9], 6)
    for seq in (a, b, other, c):
        s = add_sequence(s, seq)
    s, _ = step(s)
    assert [seq.id for seq in s.running] == ["a", "other"]  # b and c wait, other does not
    while a.computed < a.prompt_len:
        s, _ = step(s)
    s, _ = plan_step(s)
    assert b in s.running and c in s.running
    assert b.computed == c.computed == 8  # both reuse a's two full pages


def test_without_chunked_prefill_a_step_feeds_whole_prompts_and_decodes_nothing():
    s = scheduler(chunked_prefill=False)
    short = Sequence("short", [1, 2, 3], 3)
    s = add_sequence(s, short)
    s, _ = step(s)
    long = Sequence("long", list(range(16)) * 5, 80)
    s = add_sequence(s, long)
    s, plan = plan_step(s)
    assert plan.decode == []  # the running stream pauses
    assert [(seq.id, n) for seq, n in plan.prefill] == [("long", 80)]  # over the budget: alone
    s = ran(s, plan)
    s, plan = plan_step(s)
    assert plan.decode == [short, long] and plan.prefill == []


def test_while_streams_decode_prompts_get_the_smaller_budget():
    s = scheduler(prefill_chunk_decoding=4)
    first = Sequence("first", list(range(16)) * 2, 3)
    s, plan = step(add_sequence(s, first))
    assert plan.prefill == [(first, 16)] and plan.decode == []  # nobody decodes: all of it
    s, plan = step(s)
    assert plan.prefill == [(first, 16)]
    long = Sequence("long", list(range(15, -1, -1)) * 3, 48)  # nothing in common with first
    s = add_sequence(s, long)
    budgets = []  # while `first` decodes, the prompt tokens of each step
    while long.pending > 1:
        s, plan = step(s)
        assert plan.decode == [first]
        budgets.append(sum(n for _, n in plan.prefill))
    assert budgets == [4] * 12


def generating(n_tokens=4, max_len=100, **sampling):
    """A decoding sequence that has generated a token already."""
    seq = Sequence("g", list(range(n_tokens)), n_tokens - 1, SamplingParams(**sampling))
    seq.computed, seq.max_len = n_tokens - 1, max_len
    return seq


def test_decode_run_length_fits_the_time_budget_and_the_rows():
    config = EngineConfig(decode_run=8, decode_run_ms=20.0)
    plan = StepPlan([generating(), generating()], [], [])
    assert decode_run_length(plan, config, None) == 8  # not measured: decode_run
    assert decode_run_length(plan, config, 0.005) == 4  # 20 ms at 5 ms a step
    assert decode_run_length(plan, config, 0.0067) == 3  # rounded, not cut (2.98)
    assert decode_run_length(plan, config, 1.0) == 1  # a slow step runs alone
    assert decode_run_length(plan, config, 0.0) == 8  # never more than decode_run
    short = StepPlan([generating(), generating(max_len=6)], [], [])
    assert decode_run_length(short, config, None) == 2  # never past a row's max_tokens


def test_decode_run_length_is_one_unless_every_row_samples_from_its_logits_alone():
    config = EngineConfig(decode_run=8)
    one = [
        StepPlan([generating(), generating(presence_penalty=1.0)], [], []),
        StepPlan([generating(), generating(logprobs=True)], [], []),
        StepPlan([generating()], [(generating(), 3)], []),  # a prompt chunk in the step
        StepPlan([], [], []),
    ]
    first = generating()
    first.prompt_len = len(first.tokens)  # feeds its prompt's last token: nothing generated
    one.append(StepPlan([first], [], []))
    assert [decode_run_length(plan, config, None) for plan in one] == [1] * len(one)
    assert (
        decode_run_length(StepPlan([generating()], [], []), EngineConfig(decode_run=1), None) == 1
    )
