"""`just bench --peer llama.cpp` end to end at the tiny size: llama.cpp's rows join decode,
throughput and prefill, measured in the same rounds, and its greedy tokens are compared."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TYPES = ("F32", "BF16", "Q8_0", "Q4_0", "Q4_K_M")


def load_program():
    spec = importlib.util.spec_from_file_location("bench_program", ROOT / "programs" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peer_rows_in_decode_throughput_and_prefill(tmp_path, capsys):
    argv = ["--quick", "--rounds", "1", "--only", "decode,throughput,prefill", "--no-reference"]
    code = load_program().main([*argv, "--peer", "llama.cpp", "--out", str(tmp_path)])
    assert code == 0, capsys.readouterr().out
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name != "models"]
    results = json.loads((run_dir / "results.json").read_text())
    assert all(s["status"] == "ok" for s in results["sections"].values()), results["sections"]
    skipped = {s["name"] for s in results.get("skipped", [])}
    types = [t for t in TYPES if f"llama.cpp {t}" not in skipped]  # BF16 where bf16 is emulated
    for section in ("decode", "throughput", "prefill"):
        peers = {r.get("reference_name") for r in results["rows"] if r["section"] == section}
        assert {f"llama.cpp {t}" for t in types} <= peers, section
    int4 = "ours in int4" not in skipped
    for row in results["rows"]:
        if (row.get("reference_name") or "").startswith("llama.cpp"):
            assert row["reference"] > 0, row
            # at the same bits: a 4-bit file is paired with ours only when int4 runs here
            same_bits = int4 or not row["reference_name"].startswith("llama.cpp Q4")
            assert (row["ratio"] is not None and row["ratio"] > 0) == same_bits, row
    # every batch-1 decode row has the share of the bandwidth llama.cpp streams
    decode = [r for r in results["rows"] if r["section"] == "decode" and "reference_name" in r]
    assert all(r["roofline"][1] > 0 for r in decode), decode
    # and every prompt row each side's share of the compute peak of its format's products
    prompts = [
        r for r in results["rows"] if r["name"].startswith("paged prefill") and r.get("ratio")
    ]
    assert prompts and all(min(r["roofline"]) > 0 for r in prompts), prompts
    assert "compute peak, float32" in {r["name"] for r in results["rows"]}
    assert all(r["target"] is None for r in results["rows"])  # no target for the smoke model
    # the same weights: llama.cpp's F32 greedy tokens start like ours
    assert results["greedy_agreement"]["engine_vs_llama.cpp F32"] > 0.5
    assert any("extra buffer types" in note for note in results["notes"])
    # the products each format's Engine chose, every matrix of the tiny model counted
    quantized = {"int8"} | ({"int4"} if int4 else set())
    assert quantized <= set(results["kernels_by_format"])
    assert all(sum(results["kernels_by_format"][f].values()) == 2 * 4 + 1 for f in quantized)
    assert all((tmp_path / "models" / "tiny" / f"llama.cpp-{t.lower()}.gguf").exists() for t in types)  # fmt: skip


def test_llama_cpp_quantises_the_f32_file_to_4_bits(tmp_path):
    """Q4_0 and Q4_K_M written by llama.cpp's quantiser: each a fraction of the F32 file, and
    the bytes a step reads as its types say (4.5 bits a weight for Q4_0 blocks of 32)."""
    from benchmark.limits import gguf_bytes_per_token
    from benchmark.peer_llamacpp import export_models

    import astrai

    cfg = astrai.ModelConfig(
        vocab_size=512, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=512,
    )  # fmt: skip
    astrai.save_pretrained(tmp_path, astrai.init_params(cfg, seed=0), cfg)
    paths = export_models(tmp_path, ("Q4_0", "Q4_K_M"), threads=2)
    assert set(paths) == {"Q4_0", "Q4_K_M"} and (tmp_path / "llama.cpp-f32.gguf").exists()
    f32 = gguf_bytes_per_token(tmp_path / "llama.cpp-f32.gguf")
    q4 = gguf_bytes_per_token(paths["Q4_0"])
    # matrices at 4.5 / 32 of their F32 size; norms stay F32 (a few hundred floats)
    assert 4.5 / 32 < q4 / f32 < 4.5 / 32 + 0.02, q4 / f32
    assert q4 < gguf_bytes_per_token(paths["Q4_K_M"]) < f32 / 4


def test_formats_narrow_the_run_to_those_named(tmp_path, capsys):
    """--formats int8 with --quantize int8: our int8 Engine and llama.cpp's Q8_0 file alone."""
    argv = ["--quick", "--rounds", "1", "--only", "decode", "--no-reference", "--out", str(tmp_path)]  # fmt: skip
    program = load_program()
    assert program.main([*argv, "--peer", "llama.cpp", "--formats", "int9"]) == 2
    assert "unknown format(s) ['int9']" in capsys.readouterr().err
    code = program.main([*argv, "--peer", "llama.cpp", "--quantize", "int8", "--formats", "int8"])
    assert code == 0, capsys.readouterr().out
    (run_dir,) = [p for p in tmp_path.iterdir() if p.name != "models"]
    results = json.loads((run_dir / "results.json").read_text())
    peers = {r.get("reference_name") for r in results["rows"] if r["section"] == "decode"}
    assert "llama.cpp Q8_0" in peers and not peers & {f"llama.cpp {t}" for t in TYPES if t != "Q8_0"}  # fmt: skip
    assert "kernels_by_format" not in results  # no Engine in a format besides the run's own
