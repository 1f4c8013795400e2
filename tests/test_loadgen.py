"""The serving benchmark: seeded workloads, and a small run of each workload against a real
`programs/serve.py` process whose books must balance (every request answered once, with
exactly the tokens asked for, every page handed back)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
from load.client import Outcome
from load.metrics import Objective, percentile, summarize
from load.workloads import DEFAULT_SHAPES, Shape, make_workload

ROOT = Path(__file__).resolve().parents[1]


def load_program():
    spec = importlib.util.spec_from_file_location("loadgen", ROOT / "programs" / "loadgen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_workloads_are_seeded_and_every_rate_serves_the_same_requests():
    shape = DEFAULT_SHAPES["mixed"]
    a = make_workload("mixed", shape, 4096, math.inf, seed=3)
    b = make_workload("mixed", shape, 4096, 2.0, seed=3)
    assert [(j.prompt, j.output_len) for j in a] == [(j.prompt, j.output_len) for j in b]
    assert all(j.arrival_s == 0 for j in a)
    times = [j.arrival_s for j in b]
    assert times == sorted(times) and times[0] > 0
    assert b == make_workload("mixed", shape, 4096, 2.0, seed=3)
    assert a != make_workload("mixed", shape, 4096, math.inf, seed=4)
    prompts, outputs = [len(j.prompt) for j in a], [j.output_len for j in a]
    assert min(prompts) >= 16 and max(prompts) <= 1024 and min(outputs) >= 16
    assert max(outputs) <= 512
    # long-tailed: the mean sits above the median, and the longest are many times the median
    assert sum(prompts) / len(prompts) > sorted(prompts)[len(prompts) // 2]
    assert max(prompts) > 4 * sorted(prompts)[len(prompts) // 2]
    shared = make_workload("shared", Shape(8, 1000, 32), 4096, 1.0)
    assert all(j.prompt[:1000] == shared[0].prompt[:1000] for j in shared)
    assert len({tuple(j.prompt[1000:]) for j in shared}) == 8
    with pytest.raises(ValueError, match="unknown workload 'chat'"):
        make_workload("chat", shape, 4096, 1.0)


def test_summary_counts_goodput_against_the_objective():
    jobs = make_workload("shared", Shape(2, 20, 3), 100, math.inf)
    fast = Outcome(0, 0.0, [0.1, 0.2, 0.3], 3)
    slow = Outcome(1, 0.0, [2.0, 2.1, 2.2], 3)  # first token after 2 s
    figures = summarize(jobs, [fast, slow], 2.2, Objective(ttft_ms=1000, itl_ms=200))
    assert figures["good_fraction"] == 0.5
    assert figures["output_tok_s"] == pytest.approx(6 / 2.2)
    assert figures["ttft_p50_ms"] == pytest.approx(percentile([100.0, 2000.0], 50))


def test_each_workload_against_a_real_server(tmp_path):
    program = load_program()
    argv = ["--size", "tiny", "--requests", "6", "--prompt-max", "64", "--output-max", "16"]
    argv += ["--rates", "40,inf", "--variants", "engine", "--out", str(tmp_path)]
    results = program.run_bench(program.parse(argv), log=lambda line: None)
    assert program.problems(results) == []
    runs = results["runs"]
    assert {(r["workload"], r["rate"]) for r in runs} == {
        (w, rate) for w in ("mixed", "shared") for rate in (40.0, math.inf)
    }
    for run in runs:
        acc = run["accounting"]
        assert run["figures"]["completed"] == acc["requests_sent"] == 6
        assert acc["failed"] == [] and acc["wrong_token_count"] == []
        assert acc["finished_delta"] == 6  # none lost, none served twice
        assert acc["completion_tokens_delta"] == acc["completion_tokens_asked"]
        assert acc["idle_equal"] and run["stats_after"]["pages_used"] == 0
    shared_hits = [r["stats_after"]["cached_tokens"] for r in runs if r["workload"] == "shared"]
    assert shared_hits[-1] > 0  # the system prompt came from the prefix cache
    run_dir = Path(results["run_dir"])
    assert json.loads((run_dir / "results.json").read_text())["runs"]
    for workload in ("mixed", "shared"):
        assert (run_dir / f"{workload}.png").read_bytes().startswith(b"\x89PNG")


def test_static_batching_reference_times_every_token(tmp_path):
    pytest.importorskip("transformers")
    from load.static_batching import run_batches

    program = load_program()
    folder, vocab = program.served_model(tmp_path, "tiny")
    jobs = [j.__dict__ for j in make_workload("mixed", Shape(3, 32, 16), vocab, math.inf)]
    outcomes = run_batches(str(folder), jobs, batch=2, threads=1)
    assert [o["index"] for o in outcomes] == [0, 1, 2]
    for o, job in zip(outcomes, jobs):
        assert len(o["chunk_s"]) == o["completion_tokens"] == job["output_len"]
        assert o["chunk_s"] == sorted(o["chunk_s"])
    # the second batch starts after the first is done
    assert outcomes[2]["chunk_s"][0] > max(outcomes[0]["chunk_s"] + outcomes[1]["chunk_s"])
