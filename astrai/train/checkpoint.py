"""Train-state checkpoints in whichever format the state or the folder has: `save_train_state`,
`load_train_state`, `export_checkpoint`.

A whole state (one process holds every tensor) is written by that process as a
`save_pretrained` folder plus the rest of the state (astrai/train/whole_checkpoint.py); a
sharded state by every rank at once through torch.distributed.checkpoint
(astrai/train/sharded_checkpoint.py). Either format loads whole or sharded over any number of
ranks. What the two share, from the folder's name to its atomic commit, is
astrai/train/checkpoint_folder.py; neither format imports the other.
"""

from __future__ import annotations

from pathlib import Path

import torch

from astrai.config import ModelConfig, TrainConfig
from astrai.model import save_pretrained
from astrai.train.checkpoint_folder import (
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    remove_partial_checkpoints,
)
from astrai.train.model_folder import copy_tokenizer
from astrai.train.sharded import is_sharded
from astrai.train.sharded_checkpoint import (
    is_sharded_checkpoint,
    load_sharded_params,
    load_sharded_train_state,
    save_sharded_train_state,
    shard_state,
)
from astrai.train.state import TrainState, model_params
from astrai.train.whole_checkpoint import load_whole_train_state, save_whole_train_state

__all__ = [
    "checkpoint_path",
    "export_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_train_state",
    "remove_partial_checkpoints",
    "save_train_state",
]


def save_train_state(run_dir: str | Path, state: TrainState, keep: int = 3) -> Path:
    """Write the state as a new checkpoint and keep only the newest `keep`: a sharded state
    from every rank (each must call this), a whole one from the calling process."""
    if is_sharded(state.params):
        return save_sharded_train_state(run_dir, state, keep)
    return save_whole_train_state(run_dir, state, keep)


def load_train_state(
    path: str | Path,
    train_cfg: TrainConfig | None = None,
    device: str | torch.device = "cpu",
    model_cfg: ModelConfig | None = None,
    mesh=None,
) -> TrainState:
    """Read a checkpoint back into a train state (the inverse of `save_train_state`).

    train_cfg defaults to the one saved; passing the current one lets a run be extended
    (a larger max_steps) or re-tuned on resume. With a device mesh the state comes back
    sharded over it, whichever way it was written.
    """
    if is_sharded_checkpoint(path):
        return load_sharded_train_state(path, train_cfg, device, model_cfg, mesh)
    state = load_whole_train_state(path, train_cfg, device, model_cfg)
    return state if mesh is None else shard_state(state, mesh)


def export_checkpoint(path: str | Path, out: str | Path) -> Path:
    """A training checkpoint (sharded or whole) -> a model folder `load_pretrained` and
    `just serve` read (model.safetensors, config.json, tokenizer files), in one process, LoRA
    adapters merged in. Of a sharded checkpoint only the params are read, each tensor whole."""
    path, out = Path(path), Path(out)
    if not (path / "train_state.json").exists():
        raise FileNotFoundError(f"{path}: not a training checkpoint (no train_state.json)")
    if is_sharded_checkpoint(path):
        params, model_cfg = load_sharded_params(path)
    else:
        state = load_whole_train_state(path)
        params, model_cfg = model_params(state), state.model_config
    save_pretrained(out, params, model_cfg)
    copy_tokenizer(path, out)
    return out
