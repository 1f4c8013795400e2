"""MFU: the flops count by hand, the measured peak, and the progress line and metrics showing it."""

from __future__ import annotations

import torch
from tiny_run import TINY, tiny_train_config

from astrai.train import train
from astrai.train.metrics import progress_line, read_metrics
from astrai.train.mfu import matmul_peak_gflops, mfu, seq_len_of, train_flops_per_token


def test_train_flops_count_every_matrix_and_the_attention_products():
    hidden, inter, vocab, kv = 32, 64, 64, 2 * 8  # TINY: 4 heads of 8, 2 of them for k and v
    per_layer = hidden * hidden * 2 + 2 * hidden * kv + 3 * hidden * inter  # q, o, k, v, MLP
    head = vocab * hidden  # untied: lm_head.weight is a matrix of its own
    attention = 2 * 4 * 8 * 16  # layers x heads x head size x sequence
    expected = 6 * (2 * per_layer + head) + 12 * attention
    assert train_flops_per_token(TINY, 16) == expected


def test_mfu_is_the_share_of_the_measured_peak(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the record of its own
    peak = matmul_peak_gflops(torch.device("cpu"), torch.float32)
    assert peak > 0 and matmul_peak_gflops(torch.device("cpu"), torch.float32) == peak  # once
    assert mfu(1000.0, 2e6, 4.0) == 0.5
    assert seq_len_of({"input_ids": torch.zeros(2, 7), "labels": torch.zeros(2, 7)}) == 7
    assert seq_len_of({"features": torch.zeros(2, 7)}) is None  # no ids: no MFU


def test_the_progress_line_and_the_metrics_show_mfu(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    line = progress_line(5, 10, {"loss": 1.0, "lr": 1e-3, "mfu": 0.123}, 1000.0, 3.0)
    assert "MFU 12.3%" in line
    train(tiny_train_config(out_dir=str(tmp_path), max_steps=4, log_every=2))
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "tokens_per_s" in r]
    assert records and all(0 < r["mfu"] < 1 for r in records)
