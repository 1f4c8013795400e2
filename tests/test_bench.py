"""The benchmark program: a quick run end to end at the tiny size, and its pure pieces."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from benchmark import ours
from benchmark.chart import Panel, write_chart
from benchmark.isa import HELD, check_peer
from benchmark.limits import (
    decode_bytes_per_token,
    decode_flops_per_token,
    gguf_bytes_per_token,
    kv_bytes_per_token,
    mean_kv_bytes,
    prompt_flops_per_token,
    roofline_fraction,
    roofline_tokens_per_s,
)
from benchmark.run import selected_sections
from benchmark.sections import SECTIONS
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


# speculation and adapters, which train or load models of their own, have tests of their own
OWN_TESTS = {"speculation", "adapters"}


def test_quick_run_measures_every_section(tmp_path, capsys):
    only = ",".join(s for s in SECTIONS if s not in OWN_TESTS)
    argv = ["--quick", "--rounds", "1", "--only", only, "--out", str(tmp_path)]
    assert load_program().main(argv) == 0, capsys.readouterr().out
    results = read_run(tmp_path)
    assert results["meta"]["size"] == "tiny"
    assert all(s["status"] == "ok" for s in results["sections"].values()), results["sections"]
    sections = {row["section"] for row in results["rows"]}
    assert sections == set(SECTIONS) - OWN_TESTS
    for row in results["rows"]:
        assert row["ours"] > 0, row
        if "ratio" in row:
            assert row["ratio"] > 0 and row["reference"] > 0, row
    # the Engine and the hand-written loop run the same code: the same greedy tokens
    assert results["greedy_agreement"]["engine_vs_loop"] == 1.0
    # each training worker starts from the same weights and batch: the same first loss
    first = results["train_first_loss_eager"]
    assert results["train_first_loss_transformers"] == pytest.approx(first, rel=1e-4)
    # every ratio of two engines shows its agreement, and in float32 compares like things
    engines = [r for r in results["rows"] if "ratio" in r and r["section"] != "train"]
    assert {r["section"] for r in engines} == sections - {"limit", "train", "window"}
    assert all(r["verdict"] == "comparable" for r in engines), engines
    assert all(r["agreement"] is not None for r in engines if r["section"] != "structured")


def test_speculation_section_runs_in_its_quick_form(tmp_path, capsys):
    argv = ["--quick", "--rounds", "1", "--no-reference", "--only", "speculation"]
    assert load_program().main([*argv, "--out", str(tmp_path)]) == 0, capsys.readouterr().out
    results = read_run(tmp_path)
    assert results["sections"]["speculation"]["status"] == "ok", results["sections"]
    rows = results["rows"]
    assert [r["sides"] for r in rows] == [["lookup", "plain"]] + [["draft", "plain"]] * 2 + [
        ["lookup", "plain"]
    ] * 5
    for row in rows:
        assert row["ratio"] > 0 and row["verdict"] == "comparable", row
        assert 0.0 <= row["acceptance"] <= 1.0 and row["tokens_per_verification"] >= 1.0
        assert f"acceptance {row['acceptance']:.2f}" in row["name"]
        c = row["counts"]
        assert c["spec_accepted"] <= c["spec_proposed"] <= 4 * c["spec_steps"]
    # the quote's start is in the prompt: lookup proposes from the first decoding step on
    assert rows[0]["counts"]["spec_proposed"] > 0
    # the models are kept for the next run
    assert (tmp_path / "models" / "spec-tiny-20" / "draft" / "config.json").exists()


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


def test_sections_are_validated_and_decoding_and_prompts_bring_the_limits():
    assert selected_sections(("decode",)) == ["limit", "decode"]
    assert selected_sections(("prefill",)) == ["limit", "prefill"]
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
    # each batch-1 row's share of the bandwidth read in its rounds, beside the run's best read
    decode = [r for r in results["rows"] if "bytes_per_token" in r]
    assert decode and all(0 < r["roofline_in_round"][0] < 10 for r in decode), decode
    assert all(len(reads) == 1 for reads in results["decode_reads_gb_s"].values())


def test_the_int8_product_peak_is_measured_and_above_the_float32_one():
    """Quantized runs' roofline takes the int8 product's peak: the float32 peak would cap the
    int8 / int4 kernels below what they run at (a 1B int4 step at 16 rows read 140% of it)."""
    from benchmark.limits import int8_matmul_gops, matmul_gflops

    from astrai.hardware import cpu_flags

    cpu = torch.device("cpu")
    assert int8_matmul_gops(cpu, n=256, repeats=2) > 0
    if "avx512_vnni" in cpu_flags() or "avx_vnni" in cpu_flags():
        assert int8_matmul_gops(cpu, n=512, repeats=3) > matmul_gflops(cpu, torch.float32, 512)


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
    written = json.loads((tmp_path / "models" / "tiny" / "bench-shape.json").read_text())
    assert written["transformers"] is False  # written by our save_pretrained
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


# --- the shapes people run, the formats beside llama.cpp's, the roofline column -----------------


def config_of(tmp_path, size: str) -> ModelConfig:
    from benchmark.models import hf_config

    from astrai.model import model_config_from_json

    (tmp_path / "config.json").write_text(json.dumps(hf_config(size)))
    return model_config_from_json(tmp_path / "config.json")


@pytest.mark.parametrize(
    ("size", "shape", "billions"),
    [
        ("q05", (896, 24, 14, 2, 4864, 151936), 0.494),  # Qwen2.5-0.5B without its q/k/v biases
        ("1b", (2048, 16, 32, 8, 8192, 128256), 1.236),  # Llama-3.2-1B
        ("qwen3-0.6b", (1024, 28, 16, 8, 3072, 151936), 0.596),  # Qwen3-0.6B
        ("gemma3-270m", (640, 18, 4, 1, 2048, 262144), 0.268),  # Gemma-3-270M
    ],
)
def test_sizes_have_the_shapes_of_the_models_they_name(tmp_path, size, shape, billions):
    from astrai.model import param_shapes

    cfg = config_of(tmp_path, size)
    got = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.kv_heads,
           cfg.intermediate_size, cfg.vocab_size)  # fmt: skip
    assert got == shape and cfg.tie_word_embeddings
    total = sum(math.prod(s) for s in param_shapes(cfg).values())
    assert total / 1e9 == pytest.approx(billions, abs=0.0005)


def test_gemma3_size_slides_five_layers_of_six_and_qwen3_normalises_heads(tmp_path):
    gemma = config_of(tmp_path, "gemma3-270m")
    assert gemma.sliding_window == 512 and gemma.dim_per_head == 256
    full = [i for i in range(gemma.num_hidden_layers) if not gemma.is_sliding_layer(i)]
    assert full == [5, 11, 17]
    qwen3 = config_of(tmp_path, "qwen3-0.6b")
    assert qwen3.use_qk_norm and qwen3.dim_per_head == 128 and not qwen3.has_sliding_layers


def test_a_cached_model_folder_is_reused_until_its_spec_changes(tmp_path, monkeypatch):
    from benchmark import models

    folder = models.model_folder(tmp_path, "tiny")
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert models.model_folder(tmp_path, "tiny") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    monkeypatch.setitem(models.SIZES, "tiny", {**models.SIZES["tiny"], "intermediate_size": 320})
    models.model_folder(tmp_path, "tiny")
    assert astrai.load_pretrained(folder)[1].intermediate_size == 320


def test_rows_pair_ours_with_llama_cpp_at_the_same_bits():
    from benchmark.formats import FORMATS, format_of, peer_pairs, side_name

    peers = tuple(f"llama.cpp {t}" for t in ("F32", "BF16", "Q8_0", "Q4_0", "Q4_K_M"))
    sides = {"float32": "engine", "int8": "engine int8", "int4": "engine int4"}  # no bf16 here
    assert peer_pairs(sides, peers) == [
        ("engine", "llama.cpp F32"),
        ("engine int8", "llama.cpp Q8_0"),
        ("engine int4", "llama.cpp Q4_0"),
        ("engine int4", "llama.cpp Q4_K_M"),
    ]
    main = format_of("float32", "int8")
    assert main.name == "int8" and main.peers == ("Q8_0",)
    assert format_of("bfloat16", None).peers == ("BF16",)
    assert format_of("float16", None).peers == ()  # nothing of llama.cpp's at its bits here
    assert [side_name(f, main) for f in FORMATS] == ["engine float32", "engine bf16", "engine", "engine int4"]  # fmt: skip


def test_each_format_is_measured_in_a_group_of_its_own_with_both_sides_of_its_rows():
    from types import SimpleNamespace

    from benchmark.formats import FORMATS, peer_pairs
    from benchmark.sections import format_groups

    by_name = {f.name: f for f in FORMATS}
    peer = SimpleNamespace(names=tuple(f"llama.cpp {t}" for t in ("F32", "BF16", "Q8_0", "Q4_0", "Q4_K_M")))  # fmt: skip
    b = SimpleNamespace(
        peer=peer, main_format=by_name["float32"], formats={k: by_name[k] for k in ("int8", "int4")}
    )  # bf16 does not run here: its file has a group alone, paired with nothing
    names = ("engine", "engine int8", "engine int4", "loop", "transformers")
    groups = format_groups(b, names)
    assert groups == [
        (("engine", "loop", "transformers"), ("llama.cpp F32",)),
        (("engine int8",), ("llama.cpp Q8_0",)),
        (("engine int4",), ("llama.cpp Q4_0", "llama.cpp Q4_K_M")),
        ((), ("llama.cpp BF16",)),
    ]
    sides = {"float32": "engine", "int8": "engine int8", "int4": "engine int4"}
    for mine, theirs in peer_pairs(sides, peer.names):  # a row's sides are timed in turn
        assert any(mine in o and theirs in t for o, t in groups)
    # no peer, no other format: one group, as before
    assert format_groups(SimpleNamespace(peer=None, main_format=by_name["int8"], formats={}), ("engine", "loop")) == [(("engine", "loop"), ())]  # fmt: skip


def test_skip_reasons_say_why_a_format_does_not_run(monkeypatch):
    from benchmark import formats

    from astrai import hardware
    from astrai.infer import prepare as prepare_module

    monkeypatch.setattr(hardware, "native_bf16", lambda device: False)
    why = formats.bf16_skip_reason("cpu")
    assert why.startswith("bf16 is not native on this CPU") and "slower than float32" in why
    monkeypatch.setattr(hardware, "native_bf16", lambda device: True)
    assert formats.bf16_skip_reason("cpu") is None

    def refuse(params, quantize=None):
        raise ValueError(f"quantize must be one of ('int8',) or None, got {quantize!r}")

    monkeypatch.setattr(prepare_module, "prepare_params", refuse)
    monkeypatch.setattr("astrai.infer.prepare_params", refuse)
    why = formats.quantize_skip_reason("int4")
    assert why == "int4 not available in this build: quantize must be one of ('int8',) or None, got 'int4'"  # fmt: skip
    monkeypatch.setattr("astrai.infer.prepare_params", lambda params, quantize=None: params)
    assert formats.quantize_skip_reason("int4") is None  # accepted: the int4 rows run


def test_train_bf16_is_skipped_with_the_reason_where_bf16_is_emulated(tmp_path, monkeypatch, capsys):  # fmt: skip
    from benchmark import sections

    monkeypatch.setattr(sections, "bf16_skip_reason", lambda device: "bf16 is not native here")
    argv = ["--quick", "--rounds", "1", "--no-reference", "--only", "train", "--out", str(tmp_path)]
    assert load_program().main(argv) == 0
    out = capsys.readouterr().out
    assert "train: train_step bf16 (ours and transformers): skipped: bf16 is not native here" in out
    results = read_run(tmp_path)
    assert not [r for r in results["rows"] if "bf16" in r["name"] or "bfloat16" in r["name"]]
    assert results["skipped"] == [
        {"section": "train", "name": "train_step bf16 (ours and transformers)",
         "why": "bf16 is not native here"}
    ]  # fmt: skip


def test_kv_bytes_count_each_layers_window():
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=10,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    )  # fmt: skip
    per_position = 2 * 2 * 8 * 4  # K and V, 2 heads of 8, float32
    assert kv_bytes_per_token(cfg, 6, 4) == 3 * 6 * per_position  # all within the window
    assert kv_bytes_per_token(cfg, 100, 4) == (10 + 100 + 10) * per_position
    # prompt 4, 3 new tokens: steps attend to 4, 5, 6 positions
    assert mean_kv_bytes(cfg, 4, 3, 2) == pytest.approx(3 * 5 * per_position / 2)


def test_a_prompt_token_costs_two_flops_a_layer_weight_and_attention_over_what_it_sees():
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=48, sliding_window=2, tie_word_embeddings=False,
        layer_types=("sliding_attention", "full_attention"),
    )  # fmt: skip
    shapes = astrai.model.param_shapes(cfg)
    assert "lm_head.weight" in shapes  # a prefill keeping the last logits: no head per token
    weights = sum(math.prod(s) for k, s in shapes.items() if not k.endswith(("embed_tokens.weight", "lm_head.weight")))  # fmt: skip
    length = 4
    causal = torch.ones(length, length).tril()
    seen = causal.sum() / length + (causal.triu(-1)).sum() / length  # full; window of 2
    attention = 2 * 2 * cfg.num_attention_heads * cfg.dim_per_head * seen
    assert prompt_flops_per_token(cfg, length) == pytest.approx(2 * weights + attention)


def test_the_arithmetic_peak_counts_the_operations_its_widest_instructions_ran():
    from benchmark.limits import ARITHMETIC, arithmetic_peak

    from astrai.kernels.build import kernel_library

    lib = kernel_library()
    if lib is None:
        pytest.skip("our kernels do not run here")
    wide, dot = lib.astrai_gemv_isa() >= 2, lib.astrai_float_gemv_isa() >= 3
    # a multiply-add counted as two, per instruction: float32 lanes, bfloat16 pairs, int8 fours
    ops = {"float32": 32 if wide else 16, "bfloat16": 64 if dot else 32 if wide else 16}
    ops["int8"] = 128 if wide else 64  # VNNI's dot of fours; AVX2's multiply-add of byte pairs
    for kind, per_instruction in ops.items():
        assert lib.astrai_arithmetic_peak(ARITHMETIC[kind], 1000, 2) == per_instruction * 12 * 2000
        assert arithmetic_peak(kind, repeats=1) > 0
    assert lib.astrai_arithmetic_peak(3, 1000, 2) == lib.astrai_arithmetic_peak(0, 0, 2) == 0


def test_rows_against_llama_cpp_carry_their_targets_on_the_shapes_people_run():
    from types import SimpleNamespace

    from benchmark.formats import FORMATS
    from benchmark.sections import PEER_TARGETS, _reference_rows

    by_name = {f.name: f for f in FORMATS}
    files = ("F32", "Q8_0", "Q4_0", "Q4_K_M")
    rates = {"engine": [10.0], "engine int8": [30.0], "engine int4": [40.0]}
    rates |= {f"llama.cpp {t}": [r] for t, r in zip(files, (9.0, 25.0, 45.0, 40.0))}
    for size in ("q05", "tiny"):
        b = SimpleNamespace(
            size=size, peer=SimpleNamespace(names=tuple(f"llama.cpp {t}" for t in files)),
            main_format=by_name["float32"], formats={k: by_name[k] for k in ("int8", "int4")},
            skipped_formats={}, rows=[],
        )  # fmt: skip
        pairs = [("engine", "transformers", "Engine, batch 1")]
        _reference_rows(b, "decode", rates, pairs, "tok/s", peer_targets=PEER_TARGETS["decode"])
        got = {r["reference_name"]: (r["target"], r["met"]) for r in b.rows[1:]}
        if size == "tiny":  # the smoke model's rows are no test of speed
            assert set(got.values()) == {(None, None)}
            continue
        # 1.11x against 1.0, 1.2x against 1.1, 0.89x against 1.0, 1.0x against 0.9
        assert got == {
            "llama.cpp F32": (1.0, True), "llama.cpp Q8_0": (1.1, True),
            "llama.cpp Q4_0": (1.0, False), "llama.cpp Q4_K_M": (0.9, True),
        }  # fmt: skip


def test_roofline_fraction_is_streamed_bytes_over_the_bandwidth():
    from benchmark.sections import roofline_columns

    assert roofline_fraction(10.0, 2e9, 40.0) == pytest.approx(0.5)
    row = {"ours": 10.0, "reference": 30.0, "bytes_per_token": [2e9, 1e9]}
    assert roofline_columns(row, lambda n: 40.0) == pytest.approx([0.5, 0.75])
    # each side over the bandwidth of a working set its own size: a smaller one may be cached
    assert roofline_columns(row, lambda n: 60.0 if n < 1.5e9 else 40.0) == pytest.approx([0.5, 0.5])
    alone = {"ours": None, "reference": 30.0, "bytes_per_token": [None, 1e9]}
    assert roofline_columns(alone, lambda n: 40.0) == [None, pytest.approx(0.75)]
    from benchmark.report import roofline_text

    assert roofline_text([0.5, None]) == "50% / -" and roofline_text(None) == "-"
    assert roofline_text([0.5, 0.25], [0.8, 0.4]) == "50% / 25% (80% / 40%)"


def test_a_rounds_roofline_share_is_against_the_bandwidth_read_in_that_round():
    """A side that streams at the memory's speed in a slow minute and a fast one is at 100% of
    the roofline in each: against the best read of the run only the fast minute shows it."""
    from benchmark.limits import round_roofline

    bandwidths = [20.0, 40.0, 40.0]  # GB/s; 2 GB a token
    assert round_roofline([10.0, 20.0, 20.0], 2e9, bandwidths) == pytest.approx(1.0)
    # at the memory's speed in two rounds of three, one of them the slow minute
    assert round_roofline([10.0, 20.0, 10.0], 2e9, bandwidths) == pytest.approx(1.0)
    assert roofline_fraction(10.0, 2e9, 40.0) == pytest.approx(0.5)  # its median, the best read
    # at half the memory's speed in the fast rounds: no slow minute flatters it
    assert round_roofline([10.0, 10.0, 10.0], 2e9, bandwidths) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        round_roofline([10.0], 2e9, [20.0, 40.0])  # a read for each round, no fewer


def test_int4_counts_half_a_byte_per_matrix_element():
    cfg = ModelConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    assert 2 * decode_bytes_per_token(cfg, torch.float32, "int4") == decode_bytes_per_token(
        cfg, torch.float32, "int8"
    )


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_bytes_per_token_are_ours_for_an_f32_file(tmp_path, tied):
    pytest.importorskip("gguf")
    from astrai.export import save_gguf

    cfg = ModelConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=tied,
    )  # fmt: skip
    save_gguf(tmp_path / "m.gguf", astrai.init_params(cfg, seed=0), cfg, type="f32")
    # the same tensors in the same type: the head read whole, one row of the embedding
    assert gguf_bytes_per_token(tmp_path / "m.gguf") == decode_bytes_per_token(cfg, torch.float32)


def test_pages_held_by_a_sequence_without_a_window_are_all_its_pages():
    from benchmark.window import SHAPE, pages_held, window_pages

    from astrai.infer.pages import pages_for

    cfg = ModelConfig(**SHAPE, max_position_embeddings=300)
    assert pages_held(cfg, 300, 8, 16, "cpu", torch.float32) == pages_for(300, 16) == 19
    assert window_pages(256, 16) == 17  # a window not starting on a page boundary spans one more


def test_window_rows_say_whether_pages_behind_the_window_are_released(tmp_path, capsys):
    argv = [
        "--quick",
        "--rounds",
        "1",
        "--no-reference",
        "--only",
        "window",
        "--out",
        str(tmp_path),
    ]
    assert load_program().main(argv) == 0
    out = capsys.readouterr().out
    held, bound, total = [r for r in read_run(tmp_path)["rows"] if r["section"] == "window"]
    assert (bound["ours"], total["ours"], held["target"]) == (17, 64, 17)
    assert held["met"] == (held["ours"] <= 17)
    # the note is there exactly while the engine keeps pages no layer reads again
    assert ("pages behind the window are not released yet" in out) == (held["ours"] > 17)


def test_adapters_rows_compare_mixed_streams_with_base_and_merged_sides(tmp_path):
    from benchmark.adapters import ADAPTERS, RANK, TARGETS

    argv = ["--quick", "--rounds", "1", "--threads", "1", "--no-reference", "--only", "adapters"]
    assert load_program().main([*argv, "--out", str(tmp_path)]) == 0
    results = read_run(tmp_path)
    assert results["sections"]["adapters"]["status"] == "ok"
    rows = {r["name"].split(":")[0]: r for r in results["rows"] if r["section"] == "adapters"}
    speeds = [rows[side]["ours"] for side in ("adapters", "base", "merged")]
    assert all(s > 0 for s in speeds)
    ratios = [r for r in rows.values() if r["unit"] == "x" and r["target"] in (0.85, 4.0)]
    assert sorted(r["ours"] for r in ratios) == pytest.approx(
        sorted([speeds[0] / speeds[1], speeds[0] / speeds[2]])  # one round: its own ratio
    )
    # the stack's bytes: every slot's A [rank, in] and B [out, rank] of each adapted weight
    params, _ = astrai.load_pretrained(tmp_path / "models" / "tiny")
    base = sum(v.numel() * v.element_size() for v in params.values())
    adapted = [v for k, v in params.items() if k.rsplit(".", 2)[-2] in TARGETS]
    stack = ADAPTERS * RANK * sum(sum(w.shape) for w in adapted) * 4 + ADAPTERS * 4
    assert rows["memory"]["ours"] == pytest.approx((base + stack) / base)
    # the adapters' streams are their merged models' (but for rounding at a near tie)
    assert rows["streams equal to their merged model's"]["ours"] > 0.5


@pytest.mark.parametrize(
    "compare, ways",
    [("attention", {"in place", "gathered"}), ("layers", {"one call", "from Python"})],
)
def test_decode_ways_times_both_ways_and_restores_the_choices(compare, ways):
    from benchmark import decode_ways

    import astrai
    import astrai.infer.paged as paged

    cfg = astrai.ModelConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
    )  # fmt: skip
    choices = paged._reads_pages_in_place, paged.fused_layers
    params = astrai.init_params(cfg)
    with torch.inference_mode():
        times = decode_ways.step_times(params, cfg, compare, 2, 20, rounds=2, steps=1)
    assert {way: len(t) for way, t in times.items()} == dict.fromkeys(ways, 2)
    assert all(t > 0 for way in times.values() for t in way)
    assert (paged._reads_pages_in_place, paged.fused_layers) == choices


def test_isa_avx2_runs_the_program_again_with_every_library_held(tmp_path):
    script = tmp_path / "held.py"
    script.write_text(
        "import os, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parents[1] / 'programs')!r})\n"
        "from benchmark.isa import HELD, hold, held_isa\n"
        "hold('avx2')\n"
        "print(held_isa(), *(os.environ[k] for k in HELD['avx2']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in HELD["avx2"]}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["avx2", "avx2", "AVX2", "AVX2", "AVX2"]


def test_isa_avx2_refuses_a_llama_cpp_built_with_avx512(monkeypatch):
    with_avx512 = "CPU : AVX = 1 | AVX2 = 1 | FMA = 1 | AVX512 = 1 | AVX512_VNNI = 1 | "
    check_peer(with_avx512)  # not held: any build
    for name, value in HELD["avx2"].items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="without it"):
        check_peer(with_avx512)
    check_peer("CPU : AVX = 1 | AVX2 = 1 | FMA = 1 | ")
