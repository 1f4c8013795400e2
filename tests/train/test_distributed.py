"""Data parallel through torchrun (gloo, 2 CPU processes) gives the parameters of one process
training on the same global batches."""

from __future__ import annotations

import pytest
import torch
from numerics import assert_close, gradient_roundings
from tiny_run import ROOT, TINY, run_program, tiny_config, write_toml

from astrai.model import load_pretrained


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft"])
def test_two_ranks_match_one(tmp_path, kind):
    cfg = tiny_config(
        kind=kind,
        max_steps=6,
        batch_size=8,
        grad_accum=2,
        checkpoint_every=3,
        bucket_mb=0.01,  # several buckets even for a tiny model
        schedule={"name": "cosine", "warmup_steps": 2},
        # SGD's update is linear in the gradient: rounding differences stay rounding-sized
        # (Adam turns a near-zero gradient's rounding into a full-size step).
        optimizer={"name": "sgd", "lr": 0.3, "weight_decay": 0.01},
    )
    one = write_toml(tmp_path / "one.toml", {**cfg, "out_dir": "one"})
    two = write_toml(tmp_path / "two.toml", {**cfg, "out_dir": "two"})
    single = run_program(str(ROOT / "programs" / "train.py"), str(one))
    assert single.returncode == 0, single.stderr
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    multi = run_program(*launch, str(ROOT / "programs" / "train.py"), str(two), timeout=180)
    assert multi.returncode == 0, multi.stderr
    a, _ = load_pretrained(tmp_path / "one" / "model")
    b, _ = load_pretrained(tmp_path / "two" / "model")
    for k in a:
        # six steps, each a gradient over 8 rows of 24 tokens (the synthetic data's seq_len)
        assert_close(a[k], b[k], 6 * gradient_roundings(TINY, 24, 8 * 24))
    start, _ = load_pretrained(tmp_path / "one" / "checkpoints" / "step_00000003")
    assert any(not torch.equal(start[k], a[k]) for k in a)  # training did move the weights
    # Rank 0 alone wrote the log and the checkpoints.
    lines = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == len(set(lines))
