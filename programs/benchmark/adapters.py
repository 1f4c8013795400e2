"""Many LoRA adapters over one base model: what serving them in one batch costs.

16 concurrent greedy streams spread over 8 adapters of rank 16 (on q_proj and v_proj, PEFT's
default for Llama models) in one Engine, against

- the same 16 streams on the base model alone (target: at least 0.85x its tokens/s);
- each adapter served as its own merged model, one after another, 2 streams at a time
  (target: at least 4x; swapping the weights between adapters is not timed, which favours
  that side);

and the memory of the 8 adapters' stack beside the base model's weights (target: at most
1.1x the weights alone). Each side runs in a process of its own (adapter_worker.py), the
rounds alternate their order, and each side times its own generation.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from .report import figure
from .timing import interleave, median

STREAMS, ADAPTERS, RANK = 16, 8, 16
TARGETS = ("q_proj", "v_proj")
SIDES = ("adapters", "base", "merged")
VS_BASE, VS_MERGED, MEMORY = 0.85, 4.0, 1.1
WORKER = Path(__file__).resolve().parent / "adapter_worker.py"


class Worker:
    def __init__(self, process: subprocess.Popen):
        self.process = process
        self.facts: dict = {}

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self.answer()

    def answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the adapter worker exited with status {self.process.wait()}")
        return json.loads(line)


@contextlib.contextmanager
def workers(specs: dict[str, dict], threads: int | None) -> Iterator[dict[str, Worker]]:
    """{side: Worker}, every process started before any is waited for (they load at once)."""
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    started: dict[str, Worker] = {}
    try:
        for side, spec in specs.items():
            command = [sys.executable, str(WORKER), json.dumps(spec)]
            process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
            )
            started[side] = Worker(process)
        for worker in started.values():
            worker.facts = worker.answer()["facts"]
        yield started
    finally:
        for worker in started.values():
            worker.process.stdin.close()
            worker.process.wait(timeout=60)


def adapters(b) -> None:
    """The adapters section (see the module docstring): rows of tokens/s, their ratios and the
    memory ratio, and a note when a target is missed."""
    n, rounds = b.work.new_tokens, b.work.rounds
    spec = {
        "folder": str(b.folder),
        "device": str(b.device),
        "dtype": str(b.dtype).removeprefix("torch."),
        "quantize": b.quantize,
        "adapters": ADAPTERS,
        "rank": RANK,
        "targets": list(TARGETS),
        "streams": STREAMS,
        "max_len": b.work.prompt_len + n,
    }
    batches = [b.prompts(STREAMS, seed=700 + r) for r in range(rounds + 1)]
    tokens: dict[str, list] = {}
    with workers({side: {**spec, "side": side} for side in SIDES}, torch.get_num_threads()) as w:
        for worker in w.values():  # warm-up: thread pools, allocator, the products' choice
            worker.ask({"prompts": batches[0], "new_tokens": n})

        def side(name):
            def run(r):
                answer = w[name].ask({"prompts": batches[r + 1], "new_tokens": n})
                if sum(len(t) for t in answer["tokens"]) != STREAMS * n:
                    raise RuntimeError(
                        f"adapters: the {name} side did not make {n} tokens a stream"
                    )
                tokens.setdefault(name, []).append(answer["tokens"])
                return STREAMS * n / answer["seconds"]

            return run

        rates = interleave({name: side(name) for name in SIDES}, rounds)
        facts = w["adapters"].facts
    per_round = {
        other: [a / o for a, o in zip(rates["adapters"], rates[other])] for other in SIDES[1:]
    }
    label = f"{STREAMS} streams over {ADAPTERS} adapters of rank {RANK} ({'+'.join(TARGETS)})"
    for name in SIDES:
        b.rows.append(figure("adapters", f"{name}: {label if name == 'adapters' else name}",
                             "tok/s", median(rates[name]), rates[name]))  # fmt: skip
    vs_base, vs_merged = (median(per_round[o]) for o in ("base", "merged"))
    b.rows.append(figure("adapters", f"{label} / {STREAMS} base streams", "x", vs_base,
                         per_round["base"], VS_BASE))  # fmt: skip
    b.rows.append(figure("adapters", f"{label} / each adapter merged, one after another", "x",
                         vs_merged, per_round["merged"], VS_MERGED))  # fmt: skip
    memory = (facts["param_bytes"] + facts["adapter_bytes"]) / facts["param_bytes"]
    b.rows.append(figure("adapters", f"memory: base weights + {ADAPTERS} adapters / base weights",
                         "x", memory, None, MEMORY, higher_is_better=False))  # fmt: skip
    # the same adapters merged give the same greedy streams, but for rounding near a tie
    same = [a == m for ra, rm in zip(tokens["adapters"], tokens["merged"]) for a, m in zip(ra, rm)]
    b.rows.append(figure("adapters", "streams equal to their merged model's", "share",
                         sum(same) / len(same)))  # fmt: skip
    for value, target, what in ((vs_base, VS_BASE, "base streams"), (vs_merged, VS_MERGED,
                                "merged models one after another")):  # fmt: skip
        if value < target:
            b.note(f"adapters: {value:.2f}x the {what}, below the target {target}x")
    if memory > MEMORY:
        b.note(f"adapters: memory {memory:.3f}x the base weights, above the target {MEMORY}x")
