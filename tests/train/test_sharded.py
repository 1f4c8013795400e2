"""Sharded training (parallel.mode = "sharded") under torchrun with gloo on CPU processes: the
same weights as one process, 1/N of the state per rank, sharded checkpoints that resume at
another world size and survive a killed rank.

Tolerances come from the dtype and the computation (tests/numerics.py): the ranks take the
run's sums in another order, so results agree to rounding, not bit for bit, and
`step_roundings` follows that rounding through an optimizer step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from numerics import approx, forward_roundings, gradient_roundings
from tiny_run import ROOT, TINY, run_program, tiny_config, write_toml

from astrai.config import OptimizerConfig
from astrai.model import init_params, load_pretrained
from astrai.train.checkpoint import latest_checkpoint

TRAIN = str(ROOT / "programs" / "train.py")
PROBE = str(ROOT / "tests" / "train" / "sharded_probe.py")


EPS = torch.finfo(torch.float32).eps


def torchrun(nproc: int, *args: str, timeout: float = 300):
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return run_program(*launch, *args, timeout=timeout)


def sharded_config(**overrides) -> dict:
    defaults = {
        "max_steps": 3,
        "batch_size": 8,
        "grad_accum": 2,
        "log_every": 1,
        "schedule": {"name": "cosine", "warmup_steps": 1},
        "parallel": {"mode": "sharded"},
    }
    return tiny_config(**{**defaults, **overrides})


def logged(run_dir) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


def train(tmp_path, name: str, nproc: int, cfg: dict):
    toml = write_toml(tmp_path / f"{name}.toml", {**cfg, "out_dir": name})
    if nproc == 1:
        done = run_program(TRAIN, str(toml), "--fresh")
    else:
        done = torchrun(nproc, TRAIN, str(toml), "--fresh")
    assert done.returncode == 0, done.stderr[-4000:]
    return load_pretrained(tmp_path / name / "model")[0]


def batch_tokens(cfg: dict) -> int:
    return cfg["batch_size"] * cfg["data"]["seq_len"]


def step_roundings(cfg: dict) -> float:
    """The roundings in a step of two runs whose gradients are summed in another order,
    relative to the step's size.

    A gradient carries gradient_roundings relative to its terms, and once more through the clip
    factor computed from its norm. SGD's step, lr times a geometric sum of the gradients, keeps
    that relative size. AdamW's, lr * m / (sqrt(v) + eps), changes by at most
    (1 + |m| / sqrt(v)) / eps times a change of the gradients, with |m| <= 1.01 sqrt(v) over a
    few steps with these betas (Cauchy-Schwarz over the moments' weights), while it is at
    least |m| / (2 eps) when eps is at least every element of the clipped gradient: 2.01 * 2
    times the gradient's relative rounding. (With eps = 1e-8 instead, a gradient that is all
    cancellation would take a whole step either way.)"""
    opt = OptimizerConfig(**cfg["optimizer"])
    gradient = 2 * gradient_roundings(TINY, cfg["data"]["seq_len"], batch_tokens(cfg))
    if opt.name == "sgd":
        return gradient
    assert opt.name == "adamw" and opt.eps >= opt.max_grad_norm > 0
    return 2.01 * 2 * gradient


def assert_same_weights(a: dict, b: dict, cfg: dict, steps: int) -> None:
    """a's weights are b's up to the rounding of `steps` steps: each tensor apart by at most
    step_roundings eps times the largest distance training moved it in b (the errors of a sum
    are relative to its terms), and each step rounds the weight itself once (rtol)."""
    start = init_params(TINY, seed=cfg.get("seed", 0))
    for k in a:
        moved = (b[k] - start[k]).abs().max().item()
        atol = step_roundings(cfg) * EPS * moved
        torch.testing.assert_close(a[k], b[k], rtol=steps * EPS, atol=atol, msg=k)


def loss_roundings(cfg: dict) -> int:
    """A logged loss: the forward pass, the log-softmax over the vocabulary, the mean over the
    batch's tokens."""
    seq_len = cfg["data"]["seq_len"]
    return forward_roundings(TINY, seq_len) + TINY.vocab_size + batch_tokens(cfg)


def norm_roundings(cfg: dict) -> int:
    """A logged gradient norm: the gradients, then the sum of their squares."""
    whole = sum(v.numel() for v in init_params(TINY).values())
    return gradient_roundings(TINY, cfg["data"]["seq_len"], batch_tokens(cfg)) + whole


def assert_same_logs(run, reference, cfg: dict) -> None:
    for a, b in zip(logged(run), logged(reference), strict=True):
        assert a["loss"] == approx(b["loss"], loss_roundings(cfg))
        assert a["grad_norm"] == approx(b["grad_norm"], norm_roundings(cfg))


# AdamW with eps at least every element of the clipped gradient: its step stays a bounded
# function of the gradients (step_roundings).
OPTIMIZERS = {
    "sgd": {"name": "sgd", "lr": 0.3, "weight_decay": 0.01, "max_grad_norm": 0.05},
    "adamw": {"name": "adamw", "lr": 1e-2, "eps": 0.05, "weight_decay": 0.1, "max_grad_norm": 0.05},
}


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_sharded_ranks_match_one_process(tmp_path, optimizer):
    cfg = sharded_config(optimizer=OPTIMIZERS[optimizer])
    steps = cfg["max_steps"]
    one = train(tmp_path, "one", 1, cfg)
    start = init_params(TINY, seed=cfg.get("seed", 0))
    assert all(not torch.equal(start[k], one[k]) for k in one)  # training moved every tensor
    # (four ranks: test_checkpoint_of_two_ranks_resumes_on_one_and_four)
    assert_same_weights(train(tmp_path, "sharded2", 2, cfg), one, cfg, steps)
    # The logged losses and gradient norms agree as well.
    assert_same_logs(tmp_path / "sharded2", tmp_path / "one", cfg)


@pytest.mark.slow
def test_sharded_bf16_matches_one_process_in_bf16(tmp_path):
    # bf16 compute, float32 weights: a rank computes its rows in other blocks than one process
    # does, so the gradients, and the steps taken, agree to a few bf16 roundings.
    cfg = sharded_config(optimizer=OPTIMIZERS["sgd"], precision="bfloat16")
    one = train(tmp_path, "one", 1, cfg)
    two = train(tmp_path, "two", 2, cfg)
    start = init_params(TINY, seed=0)
    moved = torch.cat([(one[k] - start[k]).flatten() for k in one])
    apart = torch.cat([(two[k] - one[k]).flatten() for k in one])
    print("relative difference of the steps:", (apart.norm() / moved.norm()).item())
    assert apart.norm() <= 4 * torch.finfo(torch.bfloat16).eps * moved.norm()
    log, ref = logged(tmp_path / "two"), logged(tmp_path / "one")
    for a, b in zip(log, ref, strict=True):
        assert a["loss"] == approx(b["loss"], 4, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, replicas", [(2, 1), (4, 2)])  # sharded, hybrid
def test_each_rank_holds_a_shard_and_one_layer_at_a_time(tmp_path, nproc, replicas):
    out = tmp_path / "probe.json"
    done = torchrun(nproc, PROBE, str(out), str(replicas))
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(reports) == nproc
    shards = nproc // replicas  # hybrid: each replica group holds one whole copy
    for r in reports:
        whole, held = r["whole_bytes"], r["held_bytes"]
        # params + gradients + both AdamW moments: 1/N of the whole, up to one row per tensor
        # that does not split evenly over the ranks.
        assert whole / shards - r["slack_bytes"] <= held <= whole / shards + r["slack_bytes"]
        # Gathered weights alive at once: at most one layer plus the embedding/head and norm,
        # which are read outside the layers (not the whole model); at least the largest weight.
        assert r["largest_tensor_bytes"] <= r["peak_gathered_bytes"]
        assert r["peak_gathered_bytes"] <= r["layer_bytes"] + r["outside_layers_bytes"]


def resume(tmp_path, name: str, nproc: int, cfg: dict, checkpoint):
    toml = write_toml(tmp_path / f"{name}.toml", {**cfg, "out_dir": name})
    args = (TRAIN, str(toml), "--resume", str(checkpoint))
    done = run_program(*args) if nproc == 1 else torchrun(nproc, *args)
    assert done.returncode == 0, done.stderr[-4000:]
    return load_pretrained(tmp_path / name / "model")[0]


SGD = OPTIMIZERS["sgd"]


@pytest.mark.slow
def test_checkpoint_of_two_ranks_resumes_on_one_and_four(tmp_path):
    cfg = sharded_config(optimizer=SGD, max_steps=6, checkpoint_every=2)
    whole_run = train(tmp_path, "two", 2, cfg)
    ckpt = tmp_path / "two" / "checkpoints" / "step_00000004"
    files = {p.name for p in ckpt.iterdir()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.json"} <= files
    assert "model.safetensors" not in files  # no rank held the whole model
    # from the same state at step 4, two steps whose sums are taken in another order
    assert_same_weights(resume(tmp_path, "on1", 1, cfg, ckpt), whole_run, cfg, 2)
    assert_same_weights(resume(tmp_path, "on4", 4, cfg, ckpt), whole_run, cfg, 2)
    # The resumed runs continued from step 4, not from scratch.
    steps = [r["step"] for r in logged(tmp_path / "on4")]
    assert steps == [5, 6]
    # The sharded checkpoint exports to a model folder: the numbers the run's export gathered.
    out = tmp_path / "exported"
    last = tmp_path / "two" / "checkpoints" / "step_00000006"
    done = run_program(str(ROOT / "programs" / "export_checkpoint.py"), str(last), str(out))
    assert done.returncode == 0, done.stderr
    exported, model_cfg = load_pretrained(out)
    assert model_cfg == TINY and exported.keys() == whole_run.keys()
    for k in whole_run:
        assert torch.equal(exported[k], whole_run[k]), k


@pytest.mark.slow
def test_hybrid_sharding_matches_one_process_and_resumes_on_plain_shards(tmp_path):
    # 4 ranks as 2 replica groups of 2 shards; clipping is active, so a gradient norm that
    # counted each shard once per replica would change the weights.
    cfg = sharded_config(optimizer=SGD, max_steps=4, checkpoint_every=2)
    one = train(tmp_path, "one", 1, cfg)
    hybrid = train(tmp_path, "hybrid", 4, {**cfg, "parallel": {"mode": "sharded", "replicas": 2}})
    assert_same_weights(hybrid, one, cfg, 4)
    assert_same_logs(tmp_path / "hybrid", tmp_path / "one", cfg)
    # The checkpoint the replica groups wrote resumes on 2 ranks without replicas.
    ckpt = tmp_path / "hybrid" / "checkpoints" / "step_00000002"
    assert_same_weights(resume(tmp_path, "on2", 2, cfg, ckpt), one, cfg, 4)


def test_replicas_need_sharded_mode_and_a_positive_count():
    from astrai.config import ConfigError, train_config

    with pytest.raises(ConfigError, match=re.escape("parallel.replicas applies to mode 'sharded'")):
        train_config(tiny_config(parallel={"replicas": 2}), "run.toml")
    with pytest.raises(ConfigError, match=re.escape("parallel.replicas must be at least 1")):
        train_config(sharded_config(parallel={"mode": "sharded", "replicas": 0}), "run.toml")


@pytest.mark.slow
def test_run_with_a_killed_rank_resumes_from_the_last_sharded_checkpoint(tmp_path):
    cfg = sharded_config(optimizer=SGD, max_steps=8, checkpoint_every=2)
    uninterrupted = train(tmp_path, "whole", 2, cfg)
    toml = write_toml(tmp_path / "killed.toml", {**cfg, "out_dir": "killed"})
    pid_file = tmp_path / "rank1.pid"
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    script = str(ROOT / "tests" / "train" / "stalling_run.py")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    # Rank 1 stands still after 5 steps: the checkpoint of step 4 is complete, step 5 is not.
    run = subprocess.Popen(
        [sys.executable, *launch, script, str(toml), "5", str(pid_file)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 240
        while not pid_file.exists() or not pid_file.read_text():
            assert run.poll() is None, run.stdout.read().decode()[-4000:]
            assert time.monotonic() < deadline, "rank 1 never reached step 5"
            time.sleep(0.2)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        assert run.wait(timeout=120) != 0  # torchrun ends the whole run when a rank dies
    finally:
        if run.poll() is None:
            run.kill()
    folder = tmp_path / "killed" / "checkpoints"
    assert latest_checkpoint(tmp_path / "killed") == folder / "step_00000004"
    assert not (tmp_path / "killed" / "model").exists()
    # A save killed before its rename looks like this: the shards written, no train_state.json.
    partial = folder / ".tmp-step_00000006"
    shutil.copytree(folder / "step_00000004", partial)
    (partial / "train_state.json").unlink()
    assert latest_checkpoint(tmp_path / "killed") == folder / "step_00000004"
    done = torchrun(2, TRAIN, str(toml))  # resumes from the latest checkpoint
    assert done.returncode == 0, done.stderr[-4000:]
    assert not partial.exists()  # removed on start
    steps = [r["step"] for r in logged(tmp_path / "killed")]
    assert steps == list(range(1, 9))  # 1-4 before the kill, 5-8 after the resume
    killed = load_pretrained(tmp_path / "killed" / "model")[0]
    assert_same_weights(killed, uninterrupted, cfg, 4)  # steps 5-8 from the same state


@pytest.mark.parametrize(
    "setting, words",
    [
        ({"lora": {"rank": 4}}, "lora.rank"),
        ({"compile": True}, "compile"),
        ({"grad_engine": "func"}, "grad_engine"),
        ({"optimizer": {"name": "muon"}}, "optimizer 'muon'"),
    ],
)
def test_sharded_mode_names_what_it_does_not_support(setting, words):
    from astrai.config import ConfigError, train_config

    expected = re.escape(f"parallel.mode 'sharded' does not support {words}")
    with pytest.raises(ConfigError, match=expected):
        train_config(sharded_config(**setting), "run.toml")
    with pytest.raises(ConfigError, match=re.escape("`parallel.mode`")):
        train_config(tiny_config(parallel={"mode": "zero3"}), "run.toml")
