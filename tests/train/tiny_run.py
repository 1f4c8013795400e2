"""Tiny models, configs and TOML files shared by the training tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from astrai.config import ModelConfig, train_config

ROOT = Path(__file__).resolve().parents[2]

TINY_MODEL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}
TINY = ModelConfig(**TINY_MODEL)
TINY_MOE = ModelConfig(**{**TINY_MODEL, "ffn_type": "moe", "n_routed_experts": 4})


def tiny_config(**overrides) -> dict:
    """A training config as the dict a TOML file would hold."""
    cfg = {
        "kind": "seq",
        "max_steps": 20,
        "batch_size": 8,
        "log_every": 5,
        "progress": False,
        "model": dict(TINY_MODEL),
        "optimizer": {"lr": 3e-3, "weight_decay": 0.0},
        "schedule": {"name": "constant"},
        "data": {"source": "synthetic", "seq_len": 24},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def tiny_train_config(**overrides):
    return train_config(tiny_config(**overrides), "test")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def write_toml(path: Path, data: dict) -> Path:
    """A minimal TOML writer: scalars first, then one level of tables."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for table, values in data.items():
        if isinstance(values, dict):
            lines += ["", f"[{table}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_program(*args: str, timeout: float = 120, **popen) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=timeout, **popen
    )


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
