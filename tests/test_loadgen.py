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
from load.stream import handover_gaps, time_per_output_token, token_arrivals
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
    figures = summarize(jobs, [fast, slow], 2.2, Objective(ttft_ms=1000, tpot_ms=200))
    assert figures["good_fraction"] == 0.5
    assert figures["output_tok_s"] == pytest.approx(6 / 2.2)
    assert figures["ttft_p50_ms"] == pytest.approx(percentile([100.0, 2000.0], 50))


def sse(*events: dict | str) -> bytes:
    return b"".join(
        b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n"
        for e in events
    )


def text(t: str, finish=None) -> dict:
    return {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}


def test_tokens_handed_over_together_arrive_at_one_time():
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}
    handed = sse(text(" a"), text(" b"), text(" c"))
    reads = [
        (1.0, sse(text("t")) + b"data: "),  # an event cut in two: it arrives with its end
        (1.5, sse(text("ok"))[6:] + handed[:10]),
        (1.9, handed[10:]),
        (2.5, sse(text(" d", "length"), usage, "[DONE]")),
    ]
    arrivals = token_arrivals(reads)
    assert arrivals.stamps == [1.0, 1.5, 1.9, 1.9, 1.9, 2.5]
    assert arrivals.text == "tok a b c d"
    assert (arrivals.completion_tokens, arrivals.finish_reason) == (5, "length")


def test_time_per_output_token_and_handover_gaps_from_hand_made_timings():
    # 7 tokens: the first alone, then three hand-overs of 2 tokens each, 20 ms apart
    stamps = [0.100, 0.120, 0.120, 0.140, 0.140, 0.160, 0.160]
    assert time_per_output_token(stamps) == pytest.approx(0.060 / 6)
    assert handover_gaps(stamps) == pytest.approx([0.020, 0.020, 0.020])
    # one token a step, 10 ms apart (the static batching reference): both say 10 ms
    steps = [0.1 + 0.01 * k for k in range(7)]
    assert time_per_output_token(steps) == pytest.approx(0.010)
    assert handover_gaps(steps) == pytest.approx([0.010] * 6)
    assert time_per_output_token([0.3]) is None and handover_gaps([0.3]) == []


def test_summary_reports_tpot_per_request_and_handover_gaps_pooled():
    jobs = make_workload("shared", Shape(2, 20, 5), 100, math.inf)
    grouped = Outcome(0, 0.0, [0.1, 0.2, 0.2, 0.3, 0.3], 5)  # TPOT 50 ms, hand-overs 100 ms
    single = Outcome(1, 0.0, [0.1, 0.14, 0.18, 0.22, 0.26], 5)  # TPOT 40 ms, gaps 40 ms
    figures = summarize(jobs, [grouped, single], 0.3, Objective(ttft_ms=1000, tpot_ms=45))
    assert figures["tpot_p50_ms"] == pytest.approx(45.0)
    assert figures["tpot_p99_ms"] == pytest.approx(percentile([50.0, 40.0], 99))
    assert figures["handover_p50_ms"] == pytest.approx(40.0)  # 2 gaps of 100 ms, 4 of 40 ms
    assert figures["handover_p99_ms"] == pytest.approx(100.0)
    assert figures["good_fraction"] == 0.5  # only the 40 ms request meets 45 ms a token
    assert not any(key.startswith("itl") for key in figures)


def test_each_workload_against_a_real_server(tmp_path):
    program = load_program()
    argv = ["--size", "tiny", "--requests", "6", "--prompt-max", "64", "--output-max", "16"]
    argv += ["--rates", "40,inf", "--variants", "engine", "--out", str(tmp_path)]
    results = program.run_bench(program.parse(argv), log=lambda line: None)
    assert program.problems(results) == []
    runs = results["runs"]
    assert {(r["workload"], r["rate"]) for r in runs} == {
        (w, rate) for w in ("mixed", "shared", "grounded") for rate in (40.0, math.inf)
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


def test_grounded_requests_end_in_a_span_of_their_document_and_lookup_proposes_it(tmp_path):
    jobs = make_workload("grounded", Shape(8, 256, 64), 4096, math.inf, seed=1)
    for job in jobs:
        tail = job.prompt[-8:]
        document = job.prompt[: len(job.prompt) - 8]
        assert any(document[i : i + 8] == tail for i in range(len(document) - 7))
        assert 16 <= job.output_len <= 64
    program = load_program()
    argv = ["--size", "tiny", "--requests", "4", "--prompt-max", "64", "--output-max", "16"]
    argv += ["--rates", "inf", "--variants", "lookup", "--workloads", "grounded"]
    results = program.run_bench(program.parse([*argv, "--out", str(tmp_path)]), log=print)
    assert program.problems(results) == []
    (run,) = results["runs"]
    assert run["variant"] == "lookup" and run["figures"]["completed"] == 4
    assert run["stats_after"]["spec_proposed"] > 0  # the server speculated


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
