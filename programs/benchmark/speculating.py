"""The speculation section: the Engine with speculative decoding against the same Engine
without, each in a process of its own (isolated.py), rounds alternating, on a model trained so
that proposals can be accepted (spec_models.py):

- prompt lookup at batch 1 on grounded traffic (quoting a document given in the prompt);
- a distilled draft at batch 1 on chat-like traffic (text the prompt does not hold);
- the draft at batch 1 on grounded traffic, which it rarely guesses (it did not learn to
  copy): what the engine's adaptation leaves of the cost of a draft that misses;
- prompt lookup at batch 1 and at 16 concurrent on random prompts (the trained model soon
  repeats itself there, so lookup's proposals are in fact kept);
- prompt lookup at batch 1 and at 16 concurrent on misleading traffic (spec_models'
  misleading_prompts): the prompt holds every pair of tokens the model writes, followed by
  another token, so lookup proposes at every step and is rarely kept: what the engine's
  adaptation (rows that watch instead of verifying, a prior learned from earlier requests,
  verifying only when it pays) leaves of the cost;
- prompt lookup at 16 concurrent on grounded traffic.

Each case starts with a warm-up round in the same engines, so the measured rounds see an
engine that has served that traffic before (its prior, see speculate_step.py).

Each row prints the acceptance rate (kept / proposed tokens) and the tokens a request gains
per verification beside the ratio; both sides must do the same work (verify.same_work) and
their greedy agreement is shown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from . import spec_peer
from .models import Workload
from .report import compare
from .spec_models import (
    chat_prompts,
    grounded_prompts,
    misleading_prompts,
    random_prompts,
    spec_models,
)
from .speculation import DOC, QUOTE
from .verify import agreement, generated, same_work

K = 4
CONCURRENT = 16


def _spec(b, folder, work: Workload, settings: dict) -> dict:
    return {
        "side": "engine",
        "folder": str(folder),
        "device": str(b.device),
        "dtype": str(b.dtype).removeprefix("torch."),
        "quantize": b.quantize,
        "workload": dataclasses.asdict(work),
        "settings": settings,
    }


def rates_and_counts(b, processes, names, batches, n, group=1) -> tuple[dict, dict, dict]:
    """Interleaved rounds of the named sides on batches[1:] (batches[0] warms up) -> (rates,
    outputs, {name: counts during the measured rounds}). A round's requests are sent `group`
    at a time, each group after the previous one has ended (1: batch 1)."""

    def call(process):
        def run(batch):
            groups = [batch[i : i + group] for i in range(0, len(batch), group)]
            return [out for requests in groups for out in process.generate(requests, n)]

        return run

    calls: dict[str, Callable] = {name: call(processes[name]) for name in names}
    for warm_up in calls.values():
        warm_up(batches[0])
    before = {name: dict(processes[name].counts) for name in names}
    outputs: dict = {}
    rates = b.measure(calls, batches, n * len(batches[1]), outputs, warm_up=False)
    counts = {
        name: {k: v - before[name].get(k, 0) for k, v in processes[name].counts.items()}
        for name in names
    }
    return rates, outputs, counts


def _row(b, label, pair, rates, outputs, counts, batches) -> dict:
    spec, plain = pair
    c = counts[spec]
    acceptance = c["spec_accepted"] / c["spec_proposed"] if c["spec_proposed"] else 0.0
    per_step = (c["spec_steps"] + c["spec_accepted"]) / c["spec_steps"] if c["spec_steps"] else 1.0
    # lookup scores the proposals it did not verify against what the rows wrote: with them,
    # the share of all its proposals the model would have kept (the traffic's, before adapting)
    proposed = c["spec_proposed"] + c.get("spec_watched", 0)
    kept = c["spec_accepted"] + c.get("spec_watched_kept", 0)
    overall = f", {kept / proposed:.2f} of all {proposed} proposed" if proposed else ""
    name = (
        f"{label} (acceptance {acceptance:.2f} of {c['spec_proposed']} verified{overall},"
        f" {per_step:.2f} tokens/verification)"
    )
    row = compare("speculation", name, "tok/s", rates[spec], rates[plain], "no speculation")
    choices = {
        side: [
            generated(prompt, out)
            for r, outs in sorted(outputs[side].items())
            for prompt, out in zip(batches[r + 1], outs)
        ]
        for side in pair
    }
    row |= same_work(pair, choices[spec], choices[plain])
    row |= {
        "sides": list(pair),
        "agreement": agreement(choices[spec], choices[plain]),
        "acceptance": acceptance,
        "acceptance_of_all_proposed": kept / proposed if proposed else 0.0,
        "tokens_per_verification": per_step,
        "counts": c,
    }
    b.log(f"speculation: {name}: {row['ratio']:.2f}x, agreement {row['agreement']:.2f}")
    return row


def speculation(b) -> None:
    from .isolated import side_processes

    quick = b.work.new_tokens < 64
    n = 16 if quick else 24  # within the quotes the model learned (QUOTE tokens)
    per_round = 1 if quick else 4  # per round: requests one after another, or batches of 16
    target, draft = spec_models(b.folder.parent, b.size, quick, b.log)
    work = dataclasses.replace(
        b.work, prompt_len=DOC + QUOTE + K + 1, new_tokens=n, concurrency=(CONCURRENT,)
    )
    b.log(f"speculation: models: {target.parent}")
    specs = {
        "plain": _spec(b, target, work, {}),
        "lookup": _spec(b, target, work, {"speculative": "lookup", "speculative_k": K}),
        "draft": _spec(
            b, target, work, {"speculative": "draft", "draft_model": str(draft), "speculative_k": K}
        ),
    }
    rounds = b.work.rounds + 1

    def in_rounds(prompts, group):  # per_round groups of `group` prompts for each round
        size = per_round * group
        return [prompts[i : i + size] for i in range(0, rounds * size, size)]

    many = rounds * per_round * CONCURRENT  # prompts for the rounds of 16 concurrent
    grounded = grounded_prompts(many, n)
    cases = [
        ("lookup", f"lookup k={K} vs none, batch 1, grounded", grounded, 1),
        ("draft", f"draft k={K} vs none, batch 1, chat-like", chat_prompts(many, 32), 1),
        (
            "draft",
            f"draft k={K} vs none, batch 1, rarely accepted (grounded: the draft does not copy)",
            grounded_prompts(many, n, seed=7),
            1,
        ),
        (
            "lookup",
            f"lookup k={K} vs none, batch 1, random prompts (the model repeats itself)",
            random_prompts(many, 32),
            1,
        ),
        (
            "lookup",
            f"lookup k={K} vs none, batch 1, rarely accepted (misleading)",
            misleading_prompts(many, n),
            1,
        ),
        (
            "lookup",
            f"lookup k={K} vs none, {CONCURRENT} concurrent, random prompts",
            random_prompts(many, 32, seed=4),
            CONCURRENT,
        ),
        (
            "lookup",
            f"lookup k={K} vs none, {CONCURRENT} concurrent, rarely accepted (misleading)",
            misleading_prompts(many, n, seed=8),
            CONCURRENT,
        ),
        (
            "lookup",
            f"lookup k={K} vs none, {CONCURRENT} concurrent, grounded",
            grounded,
            CONCURRENT,
        ),
    ]
    with side_processes(specs, torch.get_num_threads()) as processes:
        for spec_side, label, prompts, group in cases:
            pair, batches = (spec_side, "plain"), in_rounds(prompts, group)
            measured = rates_and_counts(b, processes, pair, batches, n, group)
            b.rows.append(_row(b, label, pair, *measured, batches))
    spec_peer.peer_speculation(b, specs, per_round)  # with --peer llama.cpp: its rows too
