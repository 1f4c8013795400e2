"""`just bench --peer llama.cpp` end to end at the tiny size: llama.cpp's rows join decode,
throughput and prefill, measured in the same rounds, and its greedy tokens are compared."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TYPES = ("F32", "BF16", "Q8_0")


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
    for section in ("decode", "throughput", "prefill"):
        peers = {r.get("reference_name") for r in results["rows"] if r["section"] == section}
        assert {f"llama.cpp {t}" for t in TYPES} <= peers, section
    for row in results["rows"]:
        if (row.get("reference_name") or "").startswith("llama.cpp"):
            assert row["reference"] > 0 and row["ratio"] > 0, row
    # the same weights: llama.cpp's F32 greedy tokens start like ours
    assert results["greedy_agreement"]["engine_vs_llama.cpp F32"] > 0.5
    assert any("extra buffer types" in note for note in results["notes"])
    assert all((tmp_path / "models" / "tiny" / f"llama.cpp-{t}.gguf").exists() for t in ("f32", "bf16", "q8_0"))  # fmt: skip
