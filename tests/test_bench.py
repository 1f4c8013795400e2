"""The benchmark program: a quick run end to end at the tiny size, and its pure pieces."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from benchmark import ours
from benchmark.chart import Panel, write_chart
from benchmark.limits import (
    decode_bytes_per_token,
    decode_flops_per_token,
    roofline_tokens_per_s,
)
from benchmark.run import selected_sections
from benchmark.timing import interleave, percentile
from benchmark.verify import (
    agreement,
    forward_logits,
    generated,
    predicted,
    same_work,
    shortfalls,
    verdict,
)

import astrai
from astrai.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def load_program():
    spec = importlib.util.spec_from_file_location("bench_program", ROOT / "programs" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_run(out: Path) -> dict:
    (run_dir,) = [p for p in out.iterdir() if p.name != "models"]
    assert (run_dir / "chart.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert (run_dir / "results.md").read_text().startswith("| section |")
    return json.loads((run_dir / "results.json").read_text())


def test_quick_run_measures_every_section(tmp_path, capsys):
    code = load_program().main(["--quick", "--rounds", "1", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().out
    results = read_run(tmp_path)
    assert results["meta"]["size"] == "tiny"
    assert all(s["status"] == "ok" for s in results["sections"].values()), results["sections"]
    sections = {row["section"] for row in results["rows"]}
    assert sections == {
        "limit", "decode", "throughput", "prefill", "train", "structured", "serve", "isolated",
    }  # fmt: skip
    for row in results["rows"]:
        assert row["ours"] > 0, row
        if "ratio" in row:
            assert row["ratio"] > 0 and row["reference"] > 0, row
    # the Engine and the hand-written loop run the same code: the same greedy tokens
    assert results["greedy_agreement"]["engine_vs_loop"] == 1.0
    # every ratio of two engines shows its agreement, and in float32 compares like things
    engines = [r for r in results["rows"] if "ratio" in r and r["section"] != "train"]
    assert {r["section"] for r in engines} == sections - {"limit", "train"}
    assert all(r["verdict"] == "comparable" for r in engines), engines
    assert all(r["agreement"] is not None for r in engines if r["section"] != "structured")


def test_without_reference_and_with_a_missing_piece(tmp_path, monkeypatch, capsys):
    def missing(*args, **kwargs):
        raise ImportError("cannot import name 'Engine' from 'astrai.infer'")

    monkeypatch.setattr(ours, "make_engine", missing)
    argv = ["--quick", "--rounds", "1", "--no-reference", "--only", "structured,prefill"]
    code = load_program().main([*argv, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    results = read_run(tmp_path)
    assert results["sections"]["structured"]["status"].startswith("skipped: cannot import")
    assert results["sections"]["prefill"]["status"] == "ok"
    assert "skipped: cannot import" in out
    prefill_rows = [r for r in results["rows"] if r["section"] == "prefill"]
    assert prefill_rows and all("ratio" not in r for r in prefill_rows)


def test_sections_are_validated_and_decoding_brings_the_limits():
    assert selected_sections(("decode",)) == ["limit", "decode"]
    assert selected_sections(("serve", "train")) == ["train", "serve"]
    with pytest.raises(ValueError, match="unknown section"):
        selected_sections(("decoding",))


def test_chart_draws_any_text_and_values(tmp_path):
    bars = [("Décodé ~ 16", 2.5, 3.0), ("zero", 0.0, None)]
    panel = Panel("ratios", bars, 1.0, "same speed", "ours / reference (x)", "{:.2f}x")
    write_chart(tmp_path / "chart.png", "title", [panel, Panel("empty", [], 1.0, "", "", "")])
    assert (tmp_path / "chart.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_without_matplotlib_the_figures_are_written_and_the_fix_is_named(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    argv = ["--quick", "--rounds", "1", "--no-reference", "--only", "prefill"]
    assert load_program().main([*argv, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert 'pip install -e ".[plot]"' in out
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name != "models"]
    assert not (run_dir / "chart.png").exists()
    rows = json.loads((run_dir / "results.json").read_text())["rows"]
    assert any(r["section"] == "prefill" for r in rows)


def test_percentile_agrees_with_numpy():
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_interleave_alternates_the_order():
    calls = []
    sides = {name: (lambda r, name=name: calls.append((r, name)) or 1.0) for name in "ab"}
    rates = interleave(sides, 3)
    assert rates == {"a": [1.0] * 3, "b": [1.0] * 3}
    assert calls == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]


@pytest.mark.parametrize("tied", [True, False])
def test_decode_bytes_count_every_weight_once_and_one_embedding_row(tied):
    cfg = ModelConfig(
        vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=tied,
    )  # fmt: skip
    params = astrai.init_params(cfg, seed=0)
    head = params.get("lm_head.weight", params["model.embed_tokens.weight"])
    expected = sum(p.numel() for k, p in params.items() if k != "model.embed_tokens.weight")
    expected += cfg.hidden_size + (head.numel() if tied else 0)
    assert decode_bytes_per_token(cfg, torch.float32) == 4 * expected
    assert decode_bytes_per_token(cfg, torch.bfloat16) == 2 * expected
    assert decode_bytes_per_token(cfg, torch.float32, "int8") == expected


def test_quantized_run_reports_the_products_that_ran(tmp_path, capsys):
    argv = ["--quick", "--rounds", "1", "--no-reference", "--only", "decode", "--quantize",
            "int8", "--out", str(tmp_path)]  # fmt: skip
    assert load_program().main(argv) == 0, capsys.readouterr().out
    results = read_run(tmp_path)
    assert results["meta"]["quantize"] == "int8"
    # every matrix of the tiny model: per layer q-k-v fused, o, gate-up fused, down; the head
    assert sum(results["kernels"].values()) == 2 * 4 + 1
    assert "float" not in results["kernels"]
    assert results["greedy_agreement"]["engine_vs_loop"] == 1.0
    assert "our matrix products" in capsys.readouterr().out


def test_roofline_is_memory_bound_at_batch_1_and_compute_bound_when_large():
    cfg = ModelConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    limits = {
        "bandwidth_gb_s": 20.0,
        "matmul_gflops": 100.0,
        "bytes_per_token": decode_bytes_per_token(cfg, torch.float32),
        "flops_per_token": decode_flops_per_token(cfg),
    }
    # two flops per weight, and the weights are read once per step whatever the batch
    assert limits["flops_per_token"] == 2 * (limits["bytes_per_token"] // 4 - cfg.hidden_size)
    one = roofline_tokens_per_s(limits, 1)
    assert one == pytest.approx(20e9 / limits["bytes_per_token"])
    assert roofline_tokens_per_s(limits, 4) == pytest.approx(4 * one)
    assert roofline_tokens_per_s(limits, 10**6) == pytest.approx(100e9 / limits["flops_per_token"])


def test_without_transformers_our_own_folder_and_figures(tmp_path, monkeypatch, capsys):
    from benchmark import models, run

    monkeypatch.setattr(models, "has_transformers", lambda: False)
    monkeypatch.setattr(run, "has_transformers", lambda: False)
    argv = ["--quick", "--rounds", "1", "--only", "prefill", "--out", str(tmp_path)]
    assert load_program().main(argv) == 0, capsys.readouterr().out
    results = read_run(tmp_path)
    assert results["meta"]["reference_missing"] == "transformers is not installed"
    config = json.loads((tmp_path / "models" / "tiny" / "config.json").read_text())
    assert "architectures" not in config  # written by our save_pretrained
    assert all("ratio" not in r for r in results["rows"])


# --- what a comparison compares (benchmark/verify.py) -------------------------------------------


def near_tie_logits(gaps: list[float]):
    """Hand-made logits over 4 tokens for feeds of len(gaps) tokens: at position p token 0 is
    best by gaps[p] over token 1, the rest far below; a 'rounded' copy is off by 0.01 at most."""

    def exact(feed):
        logits = torch.zeros(len(feed), 4, dtype=torch.float64)
        logits[:, 0] = 1.0
        logits[:, 1] = 1.0 - torch.tensor(gaps[: len(feed)], dtype=torch.float64)
        return logits

    def rounded(feed):
        out = exact(feed).clone()
        out[:, 2] += 0.01
        return out

    return exact, rounded


def test_sides_that_part_only_where_rounding_explains_are_comparable():
    exact, rounded = near_tie_logits([0.5, 0.5, 0.02, 0.5, 0.5, 0.5])
    prompt = [3, 3]
    a = [generated(prompt, [0, 0, 0, 0])]
    b = [generated(prompt, [0, 1, 0, 0])]  # parts at position 2, where the best two nearly tie
    fields = verdict(("ours", "theirs"), (a, b), exact, (rounded, rounded))
    assert fields == {"agreement": 0.25, "verdict": "comparable", "why": None}
    assert verdict(("ours", "theirs"), (a, a), exact, (rounded, rounded))["agreement"] == 1.0


def test_a_side_choosing_beyond_rounding_makes_the_row_not_comparable():
    exact, rounded = near_tie_logits([0.5, 0.5, 0.02, 0.5, 0.5, 0.5])
    prompt = [3, 3]
    a = [generated(prompt, [0, 0, 0, 0])] * 2
    b = [generated(prompt, [0, 0, 0, 0]), generated(prompt, [0, 0, 0, 1])]  # 0.5 below the best
    fields = verdict(("ours", "theirs"), (a, b), exact, (rounded, rounded))
    assert fields["verdict"] == "not comparable"
    assert fields["agreement"] == pytest.approx((1 + 3 / 4) / 2)
    assert fields["why"].startswith("theirs, request 1: choice 3 (token 1) is 0.5 below")
    assert "rounding explains 0.04" in fields["why"]
    # a side whose rounding cannot be measured leaves the row unchecked, not comparable
    unchecked = verdict(("ours", "llama.cpp"), (a, a[:1] * 2), exact, (rounded, None))
    assert unchecked["verdict"] == "comparable"  # they agree: nothing to explain
    unchecked = verdict(("ours", "llama.cpp"), (a, b), exact, (rounded, None))
    assert unchecked["verdict"] == "unchecked" and "llama.cpp" in unchecked["why"]


def test_sides_with_different_work_are_refused():
    a = [generated([1, 2], [5, 6, 7]), generated([3, 4], [5, 6, 7])]
    fewer = [a[0], generated([3, 4], [5, 6])]
    refused = verdict(("engine", "transformers"), (a, fewer), None, (None, None))
    assert refused == {
        "agreement": None,
        "verdict": "refused",
        "why": "different work: request 1: engine chose 3 tokens, transformers 2",
    }
    other_prompt = [a[0], generated([3, 9], [5, 6, 7])]
    assert "different prompts" in same_work(("x", "y"), a, other_prompt)["why"]
    assert "answered 2 requests, y 1" in same_work(("x", "y"), a, a[:1])["why"]
    assert same_work(("x", "y"), a, a)["verdict"] == "comparable"


def test_a_forwards_predictions_agree_position_by_position():
    tokens = [7, 8, 9, 10]
    a, b = [predicted(tokens, [1, 2, 3, 4])], [predicted(tokens, [1, 0, 3, 4])]
    assert agreement(a, b) == 0.75
    assert list(a[0].positions()) == [0, 1, 2, 3] and a[0].feed() == tuple(tokens)
    last = predicted(tokens, [4])
    assert list(last.positions()) == [3]
    made = generated([7, 8], [9, 10])
    assert made.feed() == (7, 8, 9) and list(made.positions()) == [1, 2]


def test_rounding_is_measured_against_float64_at_the_very_tokens():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    params = astrai.init_params(cfg, seed=0)
    exact = forward_logits({k: v.double() for k, v in params.items()}, cfg)
    rounded = forward_logits({k: v.bfloat16() for k, v in params.items()}, cfg)
    feed = tuple(range(10))
    logits = exact(feed)
    assert logits.dtype == torch.float64 and logits.shape == (10, 64)
    best = logits.argmax(-1)
    short, explained = shortfalls(logits, rounded(feed), best)
    assert torch.equal(short, torch.zeros(10, dtype=torch.float64))
    # bf16 rounds by about 2^-8 of a value: what it explains is of that order, never zero
    assert (explained > 0).all() and (explained < 0.5 * logits.abs().amax(-1)).all()


def bench_with(monkeypatch, engine_generate):
    """The quick serve section with the Engine called directly through engine_generate."""
    monkeypatch.setattr(ours, "engine_generate", engine_generate)
    return ["--quick", "--rounds", "1", "--no-reference", "--only", "serve"]


def test_a_comparison_of_different_token_counts_is_refused(tmp_path, monkeypatch, capsys):
    real = ours.engine_generate
    argv = bench_with(monkeypatch, lambda *args, **kw: [c[:-1] for c in real(*args, **kw)])
    code = load_program().main([*argv, "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 1, out
    assert "error: serve: 8 streaming clients over HTTP: refused, different work: request 0:" in err
    (row,) = [r for r in read_run(tmp_path)["rows"] if r["unit"] == "tok/s"]
    assert row["verdict"] == "refused" and row["ratio"] is None and row["met"] is None
    assert "REFUSED" in out


def test_tokens_beyond_rounding_mark_the_ratio_not_comparable(tmp_path, monkeypatch, capsys):
    real = ours.engine_generate

    def wrong_after_two(*args, **kwargs):  # the same amount of work, other tokens
        return [c[:2] + [(t + 1) % 4096 for t in c[2:]] for c in real(*args, **kwargs)]

    argv = bench_with(monkeypatch, wrong_after_two)
    code = load_program().main([*argv, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    (row,) = [r for r in read_run(tmp_path)["rows"] if r["unit"] == "tok/s"]
    assert row["verdict"] == "not comparable" and row["ratio"] > 0
    assert row["agreement"] == pytest.approx(2 / 32)
    assert row["why"].startswith("direct, request ")
    assert f"NOT COMPARABLE: serve: {row['name']}: direct, request" in out


def test_structured_compares_one_engine_with_and_without_the_grammar(tmp_path, monkeypatch):
    made = []
    real = ours.make_engine

    def recording(params, cfg, tokenizer, work, device, dtype, quantize=None):
        made.append((tokenizer.vocab_size, quantize))
        return real(params, cfg, tokenizer, work, device, dtype, quantize)

    monkeypatch.setattr(ours, "make_engine", recording)
    argv = ["--quick", "--rounds", "1", "--no-reference", "--only", "structured"]
    assert load_program().main([*argv, "--quantize", "int8", "--out", str(tmp_path)]) == 0
    # one Engine, with the run's 8-bit weights and a tokenizer for the model's whole vocabulary
    assert made == [(4096, "int8")]
    rows = read_run(tmp_path)["rows"]
    assert [r["verdict"] for r in rows if r["section"] == "structured"] == ["comparable"] * 2
