"""Whole train-state checkpoints, written by one process that holds every tensor:

config.json, model.safetensors   the params: a `save_pretrained` folder (load_pretrained works)
train_state.safetensors          optimizer moments, LoRA adapters, RNG state
train_state.json                 step, counters, data cursor, optimizer counters, TrainConfig
tokenizer files                  copied from `tokenizer` when the config names one
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from astrai.config import ModelConfig, TrainConfig
from astrai.model import canonical_order, load_pretrained, save_pretrained
from astrai.train.checkpoint_folder import (
    by_path,
    check_moments,
    checkpoint_path,
    commit,
    read_meta,
    restored,
    saved_train_config,
    shapes,
    write_meta,
)
from astrai.train.model_folder import copy_tokenizer
from astrai.train.optim import moments
from astrai.train.state import TrainState, init_train_state


def save_whole_train_state(run_dir: str | Path, state: TrainState, keep: int = 3) -> Path:
    """Write the whole state as a new checkpoint and keep only the newest `keep`."""
    final = checkpoint_path(run_dir, state.step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_pretrained(tmp, state.params, state.model_config)
    tensors = by_path({"opt": moments(state.opt), "lora": state.lora, "rng": state.rng})
    tensors = {k: t.detach().contiguous().cpu() for k, t in tensors.items()}
    save_file(tensors, tmp / "train_state.safetensors")
    write_meta(tmp, state)
    copy_tokenizer(state.train_config.tokenizer, tmp)
    commit(tmp, final, keep)
    return final


def load_whole_train_state(
    path: str | Path,
    train_cfg: TrainConfig | None = None,
    device: str | torch.device = "cpu",
    model_cfg: ModelConfig | None = None,
) -> TrainState:
    """Read a whole checkpoint back (the inverse of `save_whole_train_state`)."""
    path = Path(path)
    meta = read_meta(path)
    params, saved_model_cfg = load_pretrained(path, device=device)
    # Fresh allocations: tensors read from a file sit at whatever alignment the file gives them,
    # and vectorised kernels round differently on unaligned memory; a resumed run must compute
    # exactly what the uninterrupted run did. The moments are copied into the fresh state's.
    params = canonical_order({k: _fresh(v, device) for k, v in params.items()}, saved_model_cfg)
    saved = load_file(path / "train_state.safetensors")
    rng = saved.pop("rng")
    tree = _unflatten(saved)
    lora = tree.get("lora")
    if lora is not None:
        weights = _ordered_like(lora["weights"], params)
        lora = {"scale": _fresh(lora["scale"], device), "weights": _fresh_tree(weights, device)}
    train_cfg = train_cfg or saved_train_config(meta)
    state = init_train_state(params, train_cfg, model_cfg or saved_model_cfg, lora)
    _copy_moments(tree.get("opt", {}), state.opt, path)
    return restored(state, meta)._replace(rng=rng)


def _copy_moments(saved: dict, opt, path: Path) -> None:
    """The saved moments into the fresh state's, which must have the same names and shapes."""
    want, have = by_path(moments(opt)), by_path(saved)
    check_moments(path, shapes(want), shapes(have))
    for k, t in want.items():
        t.copy_(have[k])


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _ordered_like(tree: dict, like: dict) -> dict:
    """`tree`'s entries in the key order of `like` (nested dicts alike)."""
    out = {}
    for k, ref in like.items():
        if k in tree:
            out[k] = _ordered_like(tree[k], ref) if isinstance(ref, dict) else tree[k]
    return out


def _fresh_tree(tree, device):
    if isinstance(tree, dict):
        return {k: _fresh_tree(v, device) for k, v in tree.items()}
    return _fresh(tree, device)


def _fresh(t: torch.Tensor, device) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(t)
    return out
