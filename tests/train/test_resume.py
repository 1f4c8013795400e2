"""Checkpoints hold the whole train state; a resumed run ends bit-exactly where a straight one
does, even when the first run was killed with SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from tiny_run import (
    ROOT,
    TINY,
    run_program,
    same_tensors,
    tiny_config,
    tiny_train_config,
    write_toml,
)

from astrai.config import train_config
from astrai.model import init_params, load_pretrained
from astrai.train import (
    BatchSource,
    init_train_state,
    list_checkpoints,
    load_train_state,
    open_batches,
    save_sharded_train_state,
    save_train_state,
    synthetic_batch,
    train,
    train_step,
)
from astrai.train.optim import moments


def _steps(state, n):
    for i in range(n):
        state, _ = train_step(state, synthetic_batch("sft", 0, i, 8, 16, TINY.vocab_size))
    return state


def _flat_lora(tree):
    return {f"{k}/{n}": t for k, pair in tree.items() for n, t in pair.items()}


@pytest.mark.parametrize("lora", [0, 4])
def test_save_and_load_round_trip_the_whole_state(tmp_path, lora):
    cfg = tiny_train_config(out_dir=str(tmp_path), lora={"rank": lora})
    state = _steps(init_train_state(init_params(TINY), cfg, cursor={"position": 24, "epoch": 0}), 3)
    path = save_train_state(tmp_path, state)
    loaded = load_train_state(path)
    assert loaded.step == 3 and loaded.cursor == state.cursor
    assert loaded.train_config == cfg and loaded.model_config == TINY
    assert same_tensors(loaded.params, state.params)
    assert torch.equal(loaded.rng, state.rng)
    assert type(loaded.opt) is type(state.opt) and loaded.opt.count == state.opt.count
    for a, b in zip(moments(loaded.opt).values(), moments(state.opt).values(), strict=True):
        if lora:
            a, b = _flat_lora(a), _flat_lora(b)
        assert same_tensors(a, b)
    if lora:
        assert torch.equal(loaded.lora["scale"], state.lora["scale"])
    # The same steps from the loaded state and from the original give the same params.
    a, b = _steps(state, 2), _steps(loaded, 2)
    assert same_tensors(a.params, b.params)
    assert load_pretrained(path)[1] == TINY  # the model part is a save_pretrained folder


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    state = init_train_state(init_params(TINY), tiny_train_config())
    for step in (2, 4, 6, 8):
        save_train_state(tmp_path, state._replace(step=step), keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000006", "step_00000008"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step_00000006",
        "step_00000008",
    ]


@pytest.mark.parametrize("save", [save_train_state, save_sharded_train_state])
def test_a_checkpoint_loaded_for_another_optimizer_names_what_does_not_fit(tmp_path, save):
    # save_sharded_train_state from one process writes DCP's files, as several ranks do
    sgd = tiny_train_config(optimizer={"name": "sgd"})
    path = save(tmp_path, _steps(init_train_state(init_params(TINY), sgd), 1))
    assert load_train_state(path).opt.count == 1
    adamw = tiny_train_config(optimizer={"name": "adamw"})
    with pytest.raises(ValueError, match=r"step_00000001: its optimizer moments do not fit.*'v"):
        load_train_state(path, adamw)
    lora = tiny_train_config(optimizer={"name": "sgd"}, lora={"rank": 4})
    with pytest.raises(ValueError, match=r"resume with the optimizer and LoRA settings"):
        load_train_state(path, lora)


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resumed_run_matches_a_straight_run(tmp_path, optimizer):
    overrides = dict(
        max_steps=12,
        checkpoint_every=4,
        schedule={"name": "cosine", "warmup_steps": 3},
        optimizer={"name": optimizer},
    )
    straight = train(tiny_train_config(out_dir=str(tmp_path / "a"), **overrides))
    cfg = tiny_train_config(out_dir=str(tmp_path / "b"), **overrides)
    source = open_batches(cfg, TINY)

    def failing_next(cursor):
        if cursor["position"] >= 9 * cfg.batch_size:
            raise Interrupted
        return source.next(cursor)

    with pytest.raises(Interrupted):
        train(cfg, batches=BatchSource(source.cursor, failing_next))
    assert list_checkpoints(tmp_path / "b")[-1].name == "step_00000008"
    resumed = train(cfg)
    assert same_tensors(resumed.params, straight.params)
    steps = [r["step"] for r in map(json.loads, (tmp_path / "b" / "metrics.jsonl").open())]
    assert steps == sorted(set(steps))  # the steps after the checkpoint were not logged twice


@pytest.mark.slow
def test_a_run_killed_mid_way_resumes_bit_exactly(tmp_path):
    cfg = tiny_config(max_steps=80, checkpoint_every=3, log_every=1, schedule={"name": "cosine"})
    toml = write_toml(tmp_path / "straight.toml", {**cfg, "out_dir": "straight"})
    killed_toml = write_toml(tmp_path / "killed.toml", {**cfg, "out_dir": "killed"})
    run_dir = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "programs" / "train.py"), str(killed_toml)],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 60
        while not any(p.name >= "step_00000006" for p in list_checkpoints(run_dir)):
            assert proc.poll() is None and time.time() < deadline, "the run ended before the kill"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "model").exists()  # it really stopped mid-way
    assert int(list_checkpoints(run_dir)[-1].name.split("_")[1]) < 80
    resumed = run_program(str(ROOT / "programs" / "train.py"), str(killed_toml))
    assert resumed.returncode == 0, resumed.stderr
    straight = run_program(str(ROOT / "programs" / "train.py"), str(toml))
    assert straight.returncode == 0, straight.stderr
    a, _ = load_pretrained(tmp_path / "straight" / "model")
    b, _ = load_pretrained(run_dir / "model")
    assert same_tensors(a, b)
    assert load_train_state(list_checkpoints(run_dir)[-1]).step == 80


def test_resume_from_a_named_checkpoint_and_fresh(tmp_path):
    cfg = tiny_train_config(out_dir=str(tmp_path), max_steps=6, checkpoint_every=2)
    train(cfg)
    first = list_checkpoints(tmp_path)[0]
    assert first.name == "step_00000002"
    again = train(cfg, resume=str(first))  # continues from step 2 to 6
    assert again.step == 6
    with pytest.raises(FileNotFoundError, match="not a training checkpoint"):
        train(cfg, resume=str(tmp_path / "nowhere"))
    fresh = train(
        train_config({**tiny_config(max_steps=6), "out_dir": str(tmp_path)}), resume=False
    )
    assert fresh.step == 6
