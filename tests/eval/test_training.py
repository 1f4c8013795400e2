"""The [eval] tasks run during training every `eval_every` steps: their metrics land in
metrics.jsonl (and in `just plot`), and the last ones equal `just eval` on the exported model."""

import json

import pytest
import torch
from eval_fixtures import TEXTS

import astrai
from astrai.config import train_config
from astrai.eval import evaluate_tasks, flat_metrics, model_of
from astrai.train import train
from astrai.train.metrics import read_metrics


def test_eval_every_runs_the_tasks_and_logs_them(model_dir, tmp_path):
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    choice = tmp_path / "choice.jsonl"
    choice.write_text(json.dumps({"prompt": "the cat", "choices": [" sat", " 42"], "answer": 0}))
    tasks = [
        {"name": "text", "kind": "perplexity", "data": str(text)},
        {"name": "mc", "kind": "choice", "data": str(choice)},
    ]
    cfg = train_config(
        {
            "init_from": str(model_dir), "tokenizer": str(model_dir), "out_dir": str(tmp_path / "run"),
            "max_steps": 4, "batch_size": 4, "eval_every": 2, "log_every": 1, "progress": False,
            "optimizer": {"lr": 1e-2}, "data": {"source": "synthetic", "seq_len": 16},
            "eval": {"tasks": tasks, "batch_size": 2},
        },
        "test",
    )  # fmt: skip
    train(cfg, resume=False)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    logged = [r for r in records if "eval/text/perplexity" in r]
    assert [r["step"] for r in logged] == [2, 4]
    assert {"eval/mc/accuracy", "eval/mc/accuracy_per_byte", "eval/text/bits_per_byte"} <= set(
        logged[-1]
    )
    assert logged[0]["eval/text/loss"] != logged[1]["eval/text/loss"]  # the weights changed

    params, model_cfg = astrai.load_pretrained(tmp_path / "run" / "model")
    model = model_of(params, model_cfg, astrai.Tokenizer.from_pretrained(model_dir))
    again = flat_metrics(evaluate_tasks(model, cfg.eval))
    eps = torch.finfo(torch.float32).eps
    for name, value in again.items():
        assert logged[-1][name] == pytest.approx(value, rel=16 * eps), name

    import plot  # programs/plot.py

    panels = {title: [s[0] for s in series] for title, _, series in plot.curves(records)}
    assert "eval/text/bits_per_byte" in panels["Held-out text"]
    assert "eval/mc/accuracy" in panels["Task accuracy"]
