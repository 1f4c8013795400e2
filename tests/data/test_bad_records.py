"""Bad input is named by file and line, and never costs what was already written."""

from __future__ import annotations

import io
import re

import pytest

from astrai.config import ConfigError
from astrai.data import (
    RecordError,
    ShardError,
    data_config,
    load_data_config,
    open_dataset,
    pipeline,
    prepare,
)


def config(tok_dir, tmp_path, **keys):
    base = {"tokenizer": str(tok_dir), "inputs": [str(tmp_path / "*.jsonl")], "kind": "sft"}
    return data_config({"output": str(tmp_path / "out"), "progress": False, **base, **keys})


def folder_bytes(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def bad_lines(chat):
    return [
        chat(0),
        "{not json",
        {"messages": "hello"},
        chat(1),
        {"text": "no messages here"},
        [1, 2],
        chat(2),
    ]


def test_bad_records_are_reported_with_file_and_line_and_counted(
    tok_dir, tmp_path, write_jsonl, chat
):
    path = write_jsonl(tmp_path / "a.jsonl", bad_lines(chat))
    log = io.StringIO()
    summary = prepare(config(tok_dir, tmp_path), log=log)
    text = log.getvalue()
    assert f"{path}:2: skipped: invalid_json" in text
    assert f"{path}:3: skipped: wrong_type" in text
    assert f"{path}:5: skipped: missing_field: no field 'messages'" in text
    assert f"{path}:6: skipped: wrong_type" in text
    assert summary.records_read == 7 and summary.records_kept == 3
    assert summary.dropped == {"invalid_json": 1, "missing_field": 1, "wrong_type": 2}
    assert "records read 7, kept 3" in text and "tokens/s" in text
    assert len(open_dataset(tmp_path / "out")) == 3


def test_strict_stops_at_the_first_bad_record_and_keeps_the_previous_output(
    tok_dir, tmp_path, write_jsonl, chat
):
    write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(5)])
    prepare(config(tok_dir, tmp_path), log=None)
    before = folder_bytes(tmp_path / "out")
    path = write_jsonl(tmp_path / "a.jsonl", bad_lines(chat))
    with pytest.raises(RecordError, match=re.escape(f"{path}:2: invalid_json")):
        prepare(config(tok_dir, tmp_path, strict=True), log=None)
    assert folder_bytes(tmp_path / "out") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "out"]  # nothing half-made
    assert len(open_dataset(tmp_path / "out")) == 5


def test_an_interrupted_run_leaves_no_complete_looking_output(
    tok_dir, tmp_path, write_jsonl, chat, monkeypatch
):
    write_jsonl(tmp_path / "a.jsonl", [chat(i, turns=3) for i in range(40)])
    cfg = config(tok_dir, tmp_path, shard_tokens=600, max_seq_len=256)
    real = pipeline.write_shard
    written = []

    def crash_on_third(folder, number, arrays):
        if number == 2:
            raise KeyboardInterrupt
        written.append(number)
        return real(folder, number, arrays)

    monkeypatch.setattr(pipeline, "write_shard", crash_on_third)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, log=None)
    assert written == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl"]
    with pytest.raises(ShardError, match=r"no index\.json"):
        open_dataset(tmp_path)


def test_a_damaged_shard_is_refused(tok_dir, tmp_path, write_jsonl, chat):
    write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(5)])
    prepare(config(tok_dir, tmp_path), log=None)
    ids = next((tmp_path / "out").glob("*.ids.bin"))
    ids.write_bytes(ids.read_bytes()[:-2])
    with pytest.raises(ShardError, match="expected"):
        open_dataset(tmp_path / "out")


def test_a_folder_that_is_not_a_dataset_is_never_replaced(tok_dir, tmp_path, write_jsonl, chat):
    write_jsonl(tmp_path / "a.jsonl", [chat(0)])
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ShardError, match="not a prepared dataset"):
        prepare(config(tok_dir, tmp_path), log=None)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_config_errors_name_the_key_and_the_file(tmp_path):
    path = tmp_path / "data.toml"
    path.write_text('tokenizer = "t"\ninputs = ["a.jsonl"]\nmax_seq_len = "long"\n')
    with pytest.raises(ConfigError, match=r"data\.toml.*max_seq_len"):
        load_data_config(path)
    path.write_text('tokenizer = "t"\ninputs = ["a.jsonl"]\npacking = "tight"\n')
    with pytest.raises(ConfigError, match=r"data\.toml.*packing"):
        load_data_config(path)
    path.write_text('tokenizer = "t"\ninputs = ["a.jsonl"]\nkind = "dpo"\npacking = "bfd"\n')
    with pytest.raises(ConfigError, match="packing must be 'none'"):
        load_data_config(path)
    path.write_text('tokenizer = "t"\ninputs = ["a.jsonl"]\nshuffle = true\n')
    with pytest.raises(ConfigError, match="shuffle"):
        load_data_config(path)


def test_an_input_pattern_that_matches_nothing_is_an_error(tok_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        prepare(config(tok_dir, tmp_path), log=None)
