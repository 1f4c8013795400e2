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
