"""programs/plot.py: a run's metrics.jsonl in, a PNG and the curves as JSON out."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLOT = runpy.run_path(str(ROOT / "programs" / "plot.py"))


def write_run(run_dir: Path) -> None:
    run_dir.mkdir()
    records = [
        {"step": s, "loss": 3.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 900.0}
        for s in range(1, 11)
    ]
    records[4]["eval_loss"] = 0.9
    records.append({"step": 10, "reward_mean": 0.5, "reward_mean/exact_match": 0.25})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_curves_become_a_png_and_json(tmp_path, capsys):
    write_run(tmp_path / "run")
    assert PLOT["main"]([str(tmp_path / "run")]) == 0, capsys.readouterr()
    assert (tmp_path / "run" / "curves.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    series = json.loads((tmp_path / "run" / "curves.json").read_text())
    assert series["eval_loss"] == {"step": [5], "value": [0.9]}
    assert series["reward_mean/exact_match"]["value"] == [0.25]
    assert series["loss"]["step"] == list(range(1, 11))


def test_without_matplotlib_the_json_is_written_and_the_fix_is_named(tmp_path, monkeypatch, capsys):
    write_run(tmp_path / "run")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises
    assert PLOT["main"]([str(tmp_path / "run")]) == 1
    assert 'pip install -e ".[plot]"' in capsys.readouterr().err
    assert (tmp_path / "run" / "curves.json").exists()
    assert not (tmp_path / "run" / "curves.png").exists()


def test_a_run_without_metrics_is_an_error_naming_the_file(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert PLOT["main"]([str(tmp_path / "run")]) == 1
    assert "metrics.jsonl" in capsys.readouterr().err
