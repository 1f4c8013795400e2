"""The loop end to end: prepared shards, DPO from a checkpoint, GRPO rollouts handed in,
metrics and curves."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_run import ROOT, TINY, TINY_MODEL, run_program, same_tensors, tiny_config, write_toml

from astrai.config import load_train_config, train_config
from astrai.model import init_params, load_pretrained, save_pretrained
from astrai.train import BatchSource, list_checkpoints, synthetic_batch, train
from astrai.train.metrics import read_metrics


def test_dpo_starts_from_init_from_and_prefers_chosen(tmp_path):
    base = init_params(TINY, seed=7)
    save_pretrained(tmp_path / "base", base, TINY)
    cfg = tiny_config(
        kind="dpo",
        init_from=str(tmp_path / "base"),
        out_dir=str(tmp_path / "run"),
        max_steps=20,
        log_every=1,
        eval_every=10,
        eval_batches=2,
        checkpoint_every=5,
        keep_checkpoints=2,
        loss={"dpo_beta": 0.5},
    )
    del cfg["model"]
    state = train(train_config(cfg, "test"))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    # The policy starts as the reference: log 2 on the first step.
    assert records[0]["loss"] == pytest.approx(0.6931, abs=1e-3)
    assert records[-1]["reward_accuracy"] == 1.0 and records[-1]["loss"] < 0.3
    assert [r["step"] for r in records if "eval_loss" in r] == [10, 20]
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == [
        "step_00000015",
        "step_00000020",
    ]
    model, cfg_back = load_pretrained(tmp_path / "run" / "model")
    assert cfg_back == TINY and same_tensors(model, state.params)
    assert not same_tensors(model, base)


def test_lora_runs_leave_an_adapter_folder_that_runs_as_the_merged_model(tmp_path):
    from numerics import assert_close, forward_roundings

    from astrai.model import forward
    from astrai.model.lora_folder import load_lora

    save_pretrained(tmp_path / "base", init_params(TINY, seed=7), TINY)
    cfg = tiny_config(
        init_from=str(tmp_path / "base"),
        out_dir=str(tmp_path / "run"),
        max_steps=5,
        lora={"rank": 4, "alpha": 8.0, "targets": ["q_proj", "down_proj"]},
    )
    del cfg["model"]
    train(train_config(cfg, "test"))
    base, _ = load_pretrained(tmp_path / "base")
    merged, _ = load_pretrained(tmp_path / "run" / "model")
    lora, lora_cfg = load_lora(tmp_path / "run", TINY)
    assert (lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets) == (4, 8.0, ("q_proj", "down_proj"))
    config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base")
    tokens = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    # the merged file summed W + s * B @ A (4 terms) before the products, not after them
    unmerged = forward(base, TINY, tokens, lora=lora)
    assert not torch.allclose(unmerged, forward(base, TINY, tokens))
    assert_close(unmerged, forward(merged, TINY, tokens), forward_roundings(TINY, 10) + 4)


def test_trains_on_shards_from_the_data_pipeline(tmp_path):
    from astrai.data import data_config, prepare
    from astrai.tokenizer import Tokenizer

    corpus = [f"the fox {i} jumps over the dog {i * 7 % 13}." for i in range(200)]
    Tokenizer.train(corpus, vocab_size=300).save_pretrained(tmp_path / "tok")
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus))
    for split, part in (("train", corpus[:160]), ("valid", corpus[160:])):
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in part)
        )
        keys = {"tokenizer": str(tmp_path / "tok"), "inputs": [str(tmp_path / f"{split}.jsonl")]}
        keys |= {"output": str(tmp_path / split), "max_seq_len": 32, "packing": "greedy"}
        prepare(data_config({**keys, "progress": False}), log=None)
    cfg = tiny_config(
        out_dir=str(tmp_path / "run"),
        tokenizer=str(tmp_path / "tok"),
        max_steps=30,
        eval_every=15,
        eval_batches=2,
        model={**TINY_MODEL, "vocab_size": 300},
        data={
            "source": "shards",
            "train": str(tmp_path / "train"),
            "valid": str(tmp_path / "valid"),
        },
    )
    state = train(train_config(cfg, "test"))
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert records[-1]["loss"] < records[0]["loss"]
    assert state.cursor["position"] > 0 or state.cursor["epoch"] > 0
    assert (tmp_path / "run" / "model" / "tokenizer.json").exists()


def test_grpo_trains_from_rollouts_handed_to_the_loop(tmp_path):
    cfg = train_config(
        tiny_config(kind="grpo", out_dir=str(tmp_path), max_steps=8, loss={"grpo_kl_beta": 0.02}),
        "test",
    )

    def rollouts(cursor):
        round_ = cursor["round"]
        return {"round": round_ + 1}, synthetic_batch("grpo", 3, round_, 8, 16, TINY.vocab_size)

    state = train(cfg, batches=BatchSource({"round": 0}, rollouts))
    assert state.step == 8 and state.cursor == {"round": 8}
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [5, 8]  # log_every 5, and the last step
    assert all("kl" in r and "clip_fraction" in r for r in records)


def test_program_trains_plots_and_reports_bad_configs(tmp_path):
    toml = write_toml(
        tmp_path / "run.toml",
        {**tiny_config(max_steps=6, log_every=2, progress=True), "out_dir": "run"},
    )
    done = run_program(str(ROOT / "programs" / "train.py"), str(toml))
    assert done.returncode == 0, done.stderr
    assert "loss" in done.stderr and (tmp_path / "run" / "model" / "config.json").exists()
    plotted = run_program(str(ROOT / "programs" / "plot.py"), str(tmp_path / "run"))
    assert plotted.returncode == 0, plotted.stderr
    png = (tmp_path / "run" / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    bad = write_toml(tmp_path / "bad.toml", tiny_config(optimizer={"lr": "fast"}))
    failed = run_program(str(ROOT / "programs" / "train.py"), str(bad))
    assert failed.returncode == 1
    assert "bad.toml" in failed.stderr and "optimizer.lr" in failed.stderr


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"optimizer": {"lr": "fast"}}, ["optimizer.lr", "float"]),
        ({"optimizer": {"learning_rate": 1.0}}, ["optimizer", "learning_rate"]),
        ({"schedule": {"name": "linear"}}, ["schedule.name"]),
        ({"optimizer": {"lr": -1.0}}, ["optimizer", "lr must be positive"]),
        ({"batch_size": 6, "grad_accum": 4}, ["batch_size", "grad_accum"]),
        ({"init_from": "somewhere"}, ["[model]", "init_from"]),
        ({"data": {"source": "shards"}}, ["data.train"]),
        ({"bogus": 1}, ["bogus"]),
        ({"grad_engine": "func", "activation_checkpointing": True}, ["grad_engine"]),
        ({"optimizer": {"name": "muon"}, "lora": {"rank": 4}}, ["'muon'", "LoRA", "adamw"]),
    ],
)
def test_bad_config_errors_name_the_key_and_the_file(tmp_path, overrides, words):
    from astrai.config import ConfigError

    path = write_toml(tmp_path / "broken.toml", tiny_config(**overrides))
    with pytest.raises(ConfigError) as info:
        load_train_config(path)
    message = str(info.value)
    assert str(path) in message
    for word in words:
        assert word in message


def test_paths_are_relative_to_the_toml_and_prepare_is_ignored(tmp_path):
    cfg = tiny_config(out_dir="runs/x", data={"source": "shards", "train": "data/train"})
    cfg["prepare"] = {"tokenizer": "tok", "inputs": ["a.jsonl"]}
    loaded = load_train_config(write_toml(tmp_path / "c.toml", cfg))
    assert loaded.out_dir == str(tmp_path / "runs" / "x")
    assert loaded.data.train == str(tmp_path / "data" / "train")


def test_docs_describe_every_key():
    import msgspec

    from astrai.config import TrainConfig

    def keys(struct, prefix=""):
        for f in msgspec.structs.fields(struct):
            if isinstance(f.default, msgspec.Struct):
                yield from keys(type(f.default), f"{prefix}{f.name}.")
            else:
                yield prefix + f.name

    text = (ROOT / "docs" / "training.md").read_text()
    documented = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `")}
    missing = set(keys(TrainConfig)) - documented
    assert not missing, f"docs/training.md does not describe {sorted(missing)}"
    assert torch.tensor(0) == 0  # torch imported for the module's fixtures
