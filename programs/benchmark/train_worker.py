"""One training side of the benchmark in a process of its own: no side's step runs in an
allocator or OpenMP team another side has shaped (our train_step has glibc keep freed blocks,
process-wide, which spares a neighbour's page faults too).

    python programs/benchmark/train_worker.py SPEC_JSON

SPEC_JSON: {"side": "ours" | "transformers", "compile": bool, "precision": "float32" |
"bfloat16", "folder", "device", "workload": {Workload fields}, "hyper": {lr, betas,
weight_decay, max_grad_norm}}. The worker makes the run's batches (one seed, so every side
trains on the same tokens), takes its first step on the first of them (for torch.compile, the
compiling) and prints {"ready": true, "facts": {"first_step_s", "first_loss", "graph_breaks"}};
then it answers each request line ({"batch": i}) with {"seconds": s, "loss": l}: one step on
batch i untimed, then the workload's train_steps steps on it, timed here. The untimed step is
there because a process's first step after another's turn runs slow, and unevenly so: up to
1.6x for transformers' eager float32 step on the small model, where ours, which keeps freed
memory, ran level (docs/benchmarks.md, "How the timing stays fair").
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmark package

import torch

import astrai
from benchmark import ours, reference
from benchmark.models import Workload, has_transformers, workload_of
from benchmark.timing import timed

Step = Callable[[dict], float]


def train_batches(vocab_size: int, work: Workload, device: torch.device) -> list[dict]:
    """The warm-up batch and one per measured round, the same on every side."""
    batch, length = work.train
    g = torch.Generator().manual_seed(4)
    shape = (batch, length)
    return [
        {"input_ids": torch.randint(0, vocab_size, shape, generator=g).to(device)}
        for _ in range(work.rounds + 1)
    ]


def load_stepper(spec: dict, work: Workload) -> tuple[Step, int]:
    """The side's step(batch) -> loss, each from the same float32 weights; and the vocabulary."""
    folder, device = Path(spec["folder"]), torch.device(spec["device"])
    hyper = {**spec["hyper"], "betas": tuple(spec["hyper"]["betas"])}
    if spec["compile"]:  # graph breaks are counted and reported, not printed as tracebacks
        torch._logging.set_logs(dynamo=logging.ERROR)
    if spec["side"] == "ours":
        params, cfg = astrai.load_pretrained(folder, dtype=torch.float32, device=device)
        step = ours.train_step_fn(params, cfg, work, spec["compile"], hyper, spec["precision"])
        return step, cfg.vocab_size
    if spec["side"] == "transformers":
        has_transformers()  # quiets its logging
        model = reference.load_reference(folder, torch.float32, device)
        bf16 = spec["precision"] == "bfloat16"
        vocab = model.config.vocab_size
        model = torch.compile(model) if spec["compile"] else model
        return reference.train_step_fn(model, **hyper, bf16=bf16), vocab
    raise ValueError(f"unknown side {spec['side']!r}")


def main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    work = workload_of(spec["workload"])
    step, vocab = load_stepper(spec, work)
    device = torch.device(spec["device"])
    batches = train_batches(vocab, work, device)
    seconds, loss = timed(lambda: step(batches[0]), device)
    facts = {
        "first_step_s": seconds,
        "first_loss": loss,
        "graph_breaks": dict(torch._dynamo.utils.counters["graph_break"]),
    }
    print(json.dumps({"ready": True, "facts": facts}), flush=True)
    for line in sys.stdin:
        batch = batches[json.loads(line)["batch"]]
        step(batch)  # settles the process after another side's turn; not timed
        timings = [timed(lambda b=batch: step(b), device) for _ in range(work.train_steps)]
        answer = {"seconds": sum(t for t, _ in timings), "loss": timings[-1][1]}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
