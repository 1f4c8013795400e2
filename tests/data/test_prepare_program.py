"""programs/prepare.py: a TOML in, shards out; errors are one line naming what was wrong."""

from __future__ import annotations

import runpy
import signal
import subprocess
import sys
from pathlib import Path

import pytest

PROGRAM = Path(__file__).resolve().parents[2] / "programs" / "prepare.py"


@pytest.fixture
def prepare_main(monkeypatch, capsys):
    """prepare_main(*args) -> (exit code, stderr), running the program in this process."""
    main = runpy.run_path(str(PROGRAM), run_name="prepare_program")["main"]

    def run(*args: str) -> tuple[int, str]:
        monkeypatch.setattr(sys, "argv", ["prepare.py", *args])
        try:
            code = main()
        except SystemExit as exc:
            code = exc.code
        return code, capsys.readouterr().err

    return run


def test_prepare_writes_shards_and_reports_errors(
    prepare_main, tok_dir, tmp_path, write_jsonl, chat
):
    write_jsonl(tmp_path / "a.jsonl", [*[chat(i) for i in range(6)], "{broken"])
    toml = tmp_path / "data.toml"
    toml.write_text(
        f'tokenizer = "{tok_dir}"\ninputs = ["a.jsonl"]\noutput = "out"\nkind = "sft"\n'
    )
    code, err = prepare_main(str(toml), "--quiet")
    assert code == 0, err
    assert "a.jsonl:7: skipped: invalid_json" in err
    assert "records read 7, kept 6" in err
    assert (tmp_path / "out" / "index.json").is_file()

    code, err = prepare_main(str(toml), "--strict", "--output", str(tmp_path / "other"))
    assert code == 1 and "a.jsonl:7: invalid_json" in err
    assert not (tmp_path / "other").exists()

    toml.write_text(f'tokenizer = "{tok_dir}"\ninputs = ["a.jsonl"]\npacking = 3\n')
    code, err = prepare_main(str(toml))
    assert code == 1 and "packing" in err and "data.toml" in err


def test_help(prepare_main):
    code, _ = prepare_main("--help")
    assert code == 0


KILLED_WRITER = """
import os, signal, sys
from astrai.data.shards import staged_output
with staged_output(sys.argv[1]) as stage:
    (stage / "00000.tokens.ids.bin").write_bytes(b"half a shard")
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_run_leaves_nothing_behind_after_the_next(
    prepare_main, tok_dir, tmp_path, write_jsonl, chat
):
    out = tmp_path / "out"
    killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(out)], check=False)
    assert killed.returncode == -signal.SIGKILL
    left = [p.name for p in tmp_path.iterdir()]
    assert any(name.startswith(".out.partial-") for name in left), left  # the crash's debris

    write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(4)])
    toml = tmp_path / "data.toml"
    toml.write_text(f'tokenizer = "{tok_dir}"\ninputs = ["a.jsonl"]\noutput = "out"\n')
    code, err = prepare_main(str(toml), "--quiet")
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "data.toml", "out"]
    assert (out / "index.json").is_file()
