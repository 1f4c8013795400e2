"""One side of the benchmark in a process of its own, the only thread there doing torch work:
no side pays for another's OpenMP team (docs/inference.md, "One compute thread").

    python programs/benchmark/side_worker.py SPEC_JSON

SPEC_JSON: {"side": "engine" | "loop" | "transformers", "folder", "device", "dtype",
"quantize", "workload": {Workload fields}, "settings": {more EngineConfig fields, engine only}}.
The worker prints {"ready": true, "facts": {...}}, then answers each request line
({"prompts": [[ids]], "new_tokens": n}) with one line ({"tokens": [[ids]], "counts": {...}}):
greedy completions of exactly n tokens, and for the engine its cumulative speculative counts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmark package

import torch

import astrai
from astrai.model import model_config_from_json
from benchmark import ours, reference
from benchmark.models import bench_tokenizer, workload_of

Generate = Callable[[list[list[int]], int], list[list[int]]]


def load_side(spec: dict) -> tuple[Generate, dict]:
    """The side's generate(prompts, new_tokens) and what it reports about itself."""
    side, folder = spec["side"], Path(spec["folder"])
    device, dtype = torch.device(spec["device"]), getattr(torch, spec["dtype"])
    if side == "transformers":
        model = reference.load_reference(folder, dtype, device)
        return lambda prompts, n: reference.generate(model, prompts, n), {}
    if side == "loop":
        params, cfg = astrai.load_pretrained(folder, dtype=dtype, device=device)
        prepared = ours.prepared(params, cfg, spec["quantize"])
        return lambda prompts, n: [ours.greedy_decode(prepared, cfg, p, n) for p in prompts], {}
    if side == "engine":
        cfg = model_config_from_json(folder / "config.json")
        work = workload_of(spec["workload"])
        # the weights are read on the engine's thread, as Engine.from_pretrained does
        load = lambda: astrai.load_pretrained(folder, dtype=dtype, device=device)[0]  # noqa: E731
        tokenizer = bench_tokenizer(cfg.vocab_size)
        settings = spec.get("settings", {})
        engine = ours.make_engine(
            load, cfg, tokenizer, work, device, dtype, spec["quantize"], **settings
        )
        generate = lambda prompts, n: ours.engine_generate(engine, prompts, n)  # noqa: E731
        return generate, {"kernels": engine.kernels, "counts": lambda: spec_counts(engine)}
    raise ValueError(f"unknown side {side!r}")


def spec_counts(engine) -> dict:
    stats = engine.stats()
    return {
        k: getattr(stats, k)
        for k in (
            "spec_steps",
            "spec_proposed",
            "spec_accepted",
            "spec_watched",
            "spec_watched_kept",
        )
    }


def main(spec_json: str) -> None:
    generate, facts = load_side(json.loads(spec_json))
    counts = facts.pop("counts", dict)
    print(json.dumps({"ready": True, "facts": facts}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        tokens = generate(request["prompts"], request["new_tokens"])
        print(json.dumps({"tokens": tokens, "counts": counts()}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
