"""Records in, shards out: reading the shards gives back exactly the tokenised records."""

from __future__ import annotations

import json

import numpy as np
import pytest

from astrai.data import (
    DataConfig,
    data_config,
    get_example,
    load_data_config,
    open_dataset,
    prepare,
)
from astrai.data.examples import encode_columns
from astrai.data.records import render_record


def config(tok_dir, tmp_path, **keys) -> DataConfig:
    base = {"tokenizer": str(tok_dir), "inputs": [str(tmp_path / "*.jsonl")]}
    return data_config({"output": str(tmp_path / "out"), "progress": False, **base, **keys})


def tokenised(cfg, tok, record) -> dict:
    [columns] = encode_columns(tok, cfg, [render_record(cfg, tok, record, "test")])
    return columns


def test_sft_rows_are_the_tokenised_records(tok, tok_dir, tmp_path, write_jsonl, chat):
    records = [chat(i, turns=1 + i % 3) for i in range(40)]
    write_jsonl(tmp_path / "a.jsonl", records[:25])
    write_jsonl(tmp_path / "b.jsonl", records[25:])
    cfg = config(tok_dir, tmp_path, kind="sft", max_seq_len=256, train_on="last_assistant")
    summary = prepare(cfg, log=None)
    data = open_dataset(cfg.output, "sft")
    assert summary.records_kept == len(data) == 40
    for i, record in enumerate(records):
        ids, mask = tokenised(cfg, tok, record)["tokens"]
        example = get_example(data, i)
        assert example["input_ids"].tolist() == ids.tolist()
        # labels are the next token where that token is trained, else -100
        expected = [*np.where(mask[1:] == 1, ids[1:], -100).tolist(), -100]
        assert example["labels"].tolist() == expected
        trained = tok.decode(ids[mask == 1], skip_special_tokens=False)
        assert trained == record["messages"][-1]["content"] + "<|im_end|>"


def test_index_names_shapes_dtypes_tokenizer_and_config(tok_dir, tmp_path, write_jsonl, chat):
    write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(10)])
    cfg = config(tok_dir, tmp_path, kind="sft", packing="bfd", positions="document")
    prepare(cfg, log=None)
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["kind"] == "sft" and index["config"]["packing"] == "bfd"
    assert len(index["tokenizer"]["sha256"]) == 64
    arrays = index["shards"][0]["arrays"]
    assert arrays["tokens.ids"]["dtype"] == "<u2"  # a 400-token vocabulary fits 16 bits
    ids = np.fromfile(tmp_path / "out" / arrays["tokens.ids"]["file"], dtype="<u2")
    assert list(ids.shape) == arrays["tokens.ids"]["shape"] == [index["counts"]["tokens"]]


def test_packed_rows_hold_each_record_once(tok, tok_dir, tmp_path, write_jsonl, chat):
    records = [chat(i, turns=1 + i % 4) for i in range(60)]
    write_jsonl(tmp_path / "a.jsonl", records)
    cfg = config(
        tok_dir, tmp_path, kind="sft", max_seq_len=320, packing="bfd", positions="document"
    )
    assert prepare(cfg, log=None).truncated == 0
    data = open_dataset(cfg.output)
    assert len(data) < 60
    got = []
    for i in range(len(data)):
        ex = get_example(data, i)
        assert len(ex["input_ids"]) <= 320
        for d in np.unique(ex["doc_ids"]):
            at = ex["doc_ids"] == d
            assert ex["positions"][at].tolist() == list(range(at.sum()))
            got.append(ex["input_ids"][at].tolist())
    want = [tokenised(cfg, tok, r)["tokens"][0].tolist() for r in records]
    assert sorted(got) == sorted(want)


def test_seq_stream_windows_cover_the_token_stream(tok, tok_dir, tmp_path, write_jsonl):
    texts = [f"document {i} says " + "fox " * (i % 7) for i in range(50)]
    write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts])
    cfg = config(tok_dir, tmp_path, kind="seq", max_seq_len=16)
    prepare(cfg, log=None)
    stream = [t for text in texts for t in [*tok.encode(text), tok.eos_id]]
    data = open_dataset(cfg.output, stride=16)
    assert len(data) == (len(stream) - 17) // 16 + 1
    for i in range(len(data)):
        ex = get_example(data, i)
        assert ex["input_ids"].tolist() == stream[16 * i : 16 * i + 16]
        # the label of a document's last token (eos) would be the next document: not trained
        nxt = stream[16 * i + 1 : 16 * i + 17]
        eos = ex["input_ids"] == tok.eos_id
        assert ex["labels"][~eos].tolist() == np.array(nxt)[~eos].tolist()
        assert (ex["labels"][eos] == -100).all()
    assert len(open_dataset(cfg.output, stride=4)) == (len(stream) - 17) // 4 + 1


def test_dpo_and_grpo_records(tok, tok_dir, tmp_path, write_jsonl):
    pairs = [
        {"prompt": f"Add {i} and 1.", "chosen": f"{i + 1}", "rejected": "no"} for i in range(8)
    ]
    write_jsonl(tmp_path / "a.jsonl", pairs)
    cfg = config(tok_dir, tmp_path, kind="dpo")
    prepare(cfg, log=None)
    data = open_dataset(cfg.output)
    ex = get_example(data, 3)
    chosen = tokenised(cfg, tok, pairs[3])["chosen"][0]
    assert ex["chosen_ids"].tolist() == chosen.tolist()
    assert tok.decode(ex["chosen_labels"][ex["chosen_labels"] >= 0]) == "4"
    assert tok.decode(ex["rejected_labels"][ex["rejected_labels"] >= 0]) == "no"

    (tmp_path / "a.jsonl").unlink()
    problems = [
        {"prompt": f"What is {i} + 2?", "answer": str(i + 2), "level": i % 3} for i in range(5)
    ]
    write_jsonl(tmp_path / "g.jsonl", problems)
    cfg = config(tok_dir, tmp_path, kind="grpo")
    prepare(cfg, log=None)
    data = open_dataset(cfg.output)
    ex = get_example(data, 4)
    assert ex["record"] == problems[4]
    prompt = tok.apply_chat_template([{"role": "user", "content": problems[4]["prompt"]}])
    assert ex["prompt_ids"] == tok.encode(prompt)


def test_jsonl_and_toml_read_directly_equal_prepared_shards(tok_dir, tmp_path, write_jsonl, chat):
    write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(12)])
    (tmp_path / "data.toml").write_text(
        f'tokenizer = "{tok_dir}"\ninputs = ["a.jsonl"]\noutput = "out"\nkind = "sft"\n'
        "progress = false\nmax_seq_len = 128\n"
    )
    cfg = load_data_config(tmp_path / "data.toml")
    assert cfg.output == str(tmp_path / "out")  # relative to the TOML's folder
    prepare(cfg, log=None)
    prepared = open_dataset(tmp_path / "out")
    from_toml = open_dataset(tmp_path / "data.toml")
    from_jsonl = open_dataset(tmp_path / "a.jsonl", "sft", tokenizer=str(tok_dir), max_seq_len=128)
    for data in (from_toml, from_jsonl):
        assert len(data) == len(prepared) == 12
        for i in range(12):
            a, b = get_example(prepared, i), get_example(data, i)
            assert a.keys() == b.keys()
            assert all(np.array_equal(a[k], b[k]) for k in a)


def test_keys_may_sit_under_a_prepare_table(tok, tok_dir, tmp_path, write_jsonl):
    write_jsonl(tmp_path / "a.jsonl", [{"q": "1 + 1?", "a": "2"}])
    (tmp_path / "run.toml").write_text(
        f'[prepare]\ntokenizer = "{tok_dir}"\ninputs = ["a.jsonl"]\nkind = "sft"\n'
        'format = "prompt_response"\ntemplate = "plain"\nfields = {prompt = "q", response = "a"}\n'
        "[model]\nhidden_size = 64\n"
    )
    data = open_dataset(tmp_path / "run.toml", tokenizer=tok)
    example = get_example(data, 0)
    assert example["input_ids"].tolist() == [*tok.encode("1 + 1?"), *tok.encode("2"), tok.eos_id]
    assert tok.decode(example["labels"][example["labels"] >= 0]) == "2"
    assert data.index["tokenizer"]["sha256"] is None  # a tokenizer given, not read from a folder


def test_workers_give_the_same_shards(tok_dir, tmp_path, write_jsonl, chat):
    write_jsonl(tmp_path / "a.jsonl", [chat(i, turns=1 + i % 3) for i in range(90)])
    keys = {"kind": "sft", "batch_records": 7, "shard_tokens": 1000, "max_seq_len": 256}
    one = config(tok_dir, tmp_path, **keys)
    two = config(tok_dir, tmp_path, **keys, workers=2, output=str(tmp_path / "out2"))
    prepare(one, log=None)
    prepare(two, log=None)
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len([f for f in files if f.endswith(".ids.bin")]) > 1  # several shards
    assert files == sorted(p.name for p in (tmp_path / "out2").iterdir())
    for name in files:
        if name != "index.json":
            assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "out2" / name).read_bytes()


@pytest.mark.parametrize("too_long", ["truncate", "drop", "split"])
def test_too_long_records_are_counted(tok_dir, tmp_path, write_jsonl, too_long):
    write_jsonl(tmp_path / "a.jsonl", [{"text": "fox " * n} for n in (2, 40, 3, 80)])
    cfg = config(tok_dir, tmp_path, kind="sft", format="text", max_seq_len=20, too_long=too_long)
    summary = prepare(cfg, log=None)
    data = open_dataset(cfg.output)
    counts = {"truncate": (4, 2, 0, 0), "drop": (2, 0, 0, 2), "split": (4, 0, 2, 0)}[too_long]
    assert (summary.records_kept, summary.truncated, summary.split) == counts[:3]
    assert summary.dropped.get("too_long", 0) == counts[3]
    assert all(len(get_example(data, i)["input_ids"]) <= 20 for i in range(len(data)))
