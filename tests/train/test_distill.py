"""Distillation: a small student learns a teacher's next-token distributions; the [distill]
table names a model folder that must exist and share the student's vocabulary."""

from __future__ import annotations

import pytest
from numerics import approx, forward_roundings
from tiny_run import TINY, TINY_MODEL, tiny_config, write_toml

from astrai.config import (
    ConfigError,
    DistillConfig,
    LossConfig,
    ModelConfig,
    load_train_config,
    train_config,
)
from astrai.model import init_params, save_pretrained
from astrai.train import init_train_state, synthetic_batch, train, train_step
from astrai.train.distill import with_teacher_logps
from astrai.train.losses import distill_loss
from astrai.train.metrics import read_metrics

# a student with a quarter of the teacher's width and half its layers
STUDENT = {**TINY_MODEL, "hidden_size": 16, "num_hidden_layers": 1, "intermediate_size": 32}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """A tiny model trained a little on the synthetic counting task: its greedy choices
    follow a pattern a student can learn, which random weights' would not."""
    out = tmp_path_factory.mktemp("teacher")
    cfg = tiny_config(out_dir=str(out), max_steps=30, batch_size=16, log_every=30)
    train(train_config(cfg, "test"))
    return str(out / "model")


def test_a_student_learns_its_teacher(tmp_path, teacher):
    cfg = tiny_config(
        out_dir=str(tmp_path / "draft"),
        max_steps=40,
        batch_size=16,
        log_every=1,
        model=STUDENT,
        optimizer={"lr": 1e-2},
        distill={"teacher": teacher, "ce_weight": 0.1},
    )
    train(train_config(cfg, "test"))
    records = read_metrics(tmp_path / "draft" / "metrics.jsonl")
    first, last = records[:5], records[-5:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "kl") < 0.5 * mean(first, "kl")
    assert mean(last, "loss") < mean(first, "loss")
    assert mean(last, "teacher_agreement") > mean(first, "teacher_agreement") + 0.2


def test_a_student_equal_to_its_teacher_has_no_divergence():
    params = init_params(TINY, seed=3)
    batch = synthetic_batch("seq", 0, 0, 4, 16, TINY.vocab_size)
    distill = DistillConfig(teacher="same", temperature=2.0)
    batch = with_teacher_logps(batch, (params, TINY), distill.temperature)
    loss, metrics = distill_loss(params, TINY, batch, LossConfig(), distill)
    # KL sums vocab_size terms of log-prob differences, each carrying a forward's roundings
    roundings = forward_roundings(TINY, 16) * TINY.vocab_size
    assert float(loss) == approx(0.0, roundings)
    assert float(metrics["teacher_agreement"]) == 1.0
    assert metrics["weight"] == 4 * 15


def test_a_batch_without_the_teachers_logps_is_refused(teacher):
    cfg = train_config(tiny_config(distill={"teacher": teacher}), "test")
    state = init_train_state(init_params(TINY, seed=0), cfg)
    with pytest.raises(ValueError, match="teacher_logps"):
        train_step(state, synthetic_batch("seq", 0, 0, 8, 16, TINY.vocab_size))


def test_distill_settings_are_checked(tmp_path, teacher):
    missing = write_toml(tmp_path / "a.toml", tiny_config(distill={"teacher": "nowhere"}))
    with pytest.raises(ConfigError, match=r"distill.teacher: .*nowhere is not a model folder"):
        train(load_train_config(missing))
    other_vocab = tiny_config(model={"vocab_size": 128}, distill={"teacher": teacher})
    with pytest.raises(ConfigError, match=r"distill\.teacher: .*vocabulary of 64 tokens.* 128"):
        train(load_train_config(write_toml(tmp_path / "b.toml", other_vocab)))
    with pytest.raises(ValueError, match=r"distill\.teacher: kind must be"):
        train_config(tiny_config(kind="dpo", distill={"teacher": teacher}), "test")
    with pytest.raises(ValueError, match=r"distill\.ce_weight"):
        train_config(tiny_config(distill={"teacher": teacher, "ce_weight": 1.5}), "test")
    with pytest.raises(ValueError, match="temperature"):
        train_config(tiny_config(distill={"temperature": 0.0}), "test")


def test_an_init_from_student_is_checked_when_the_run_starts(tmp_path, teacher):
    other = {**TINY_MODEL, "vocab_size": 96}
    save_pretrained(
        tmp_path / "start", init_params(ModelConfig(**other), seed=0), ModelConfig(**other)
    )
    cfg = tiny_config(
        init_from=str(tmp_path / "start"),
        out_dir=str(tmp_path / "run"),
        distill={"teacher": teacher},
    )
    del cfg["model"]
    with pytest.raises(ConfigError, match="vocabulary of 64 tokens, the student's has 96"):
        train(train_config(cfg, "test"))
