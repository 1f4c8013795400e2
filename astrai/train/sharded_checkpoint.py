"""Sharded train-state checkpoints through torch.distributed.checkpoint (DCP).

Every rank writes its own shards at once (`__RANK_0.distcp` files); DCP's `.metadata` records
where each piece of each global tensor lies, so a checkpoint loads at any world size: DCP
reads, for each rank of the new layout, just the pieces its shards need (resharding on load),
and a single process reads whole tensors. The folder holds

    .metadata, __*_*.distcp      params, optimizer moments and the RNG state, by DCP
    config.json                  the model's shape
    train_state.json             step, counters, data cursor, optimizer counters, TrainConfig
    tokenizer files              copied from `tokenizer` when the config names one

All ranks write into one temporary folder, which rank 0 commits once every rank has written
(astrai/train/checkpoint_folder.py).
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor import empty as sharded_empty

from astrai.config import ModelConfig, TrainConfig, write_model_config
from astrai.model import model_config_from_json, param_shapes
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
from astrai.train.distributed import barrier
from astrai.train.model_folder import copy_tokenizer
from astrai.train.optim import moments
from astrai.train.sharded import placements
from astrai.train.state import TrainState, init_train_state


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / ".metadata").exists()


def _tensors(state: TrainState) -> dict:
    """What DCP stores: the params, the optimizer's moment trees and the RNG state."""
    return {"params": state.params, "opt": moments(state.opt), "rng": state.rng}


def save_sharded_train_state(run_dir: str | Path, state: TrainState, keep: int = 3) -> Path:
    """Write a sharded state as a new checkpoint (every rank must call this) and keep only the
    newest `keep` checkpoints."""
    final = checkpoint_path(run_dir, state.step)
    tmp = final.with_name(
        f".tmp-{final.name}"
    )  # one name for all ranks: they write into one folder
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    _dcp(dcp.save, _tensors(state), tmp)  # returns once every rank's part is written
    if main:
        write_meta(tmp, state, layout="sharded")
        write_model_config(tmp / "config.json", state.model_config)
        copy_tokenizer(state.train_config.tokenizer, tmp)
        commit(tmp, final, keep)
    barrier()
    return final


def load_sharded_train_state(
    path: str | Path,
    train_cfg: TrainConfig | None = None,
    device: str | torch.device = "cpu",
    model_cfg: ModelConfig | None = None,
    mesh: DeviceMesh | None = None,
) -> TrainState:
    """Read a sharded checkpoint into a state sharded over `mesh` (any number of ranks), or into
    whole tensors when mesh is None."""
    path = Path(path)
    meta = read_meta(path)
    saved_model_cfg = model_config_from_json(path / "config.json")
    params = _empty_params(saved_model_cfg, device, mesh)
    train_cfg = train_cfg or saved_train_config(meta)
    state = init_train_state(params, train_cfg, model_cfg or saved_model_cfg)
    tensors = _tensors(state)
    check_moments(path, shapes(by_path(tensors["opt"], ".")), _saved_moment_shapes(path))
    _dcp(dcp.load, tensors, path)  # fills the tensors in place, in this layout
    return restored(state, meta)._replace(rng=tensors["rng"])


def load_sharded_params(path: str | Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    """The params of a sharded checkpoint as whole tensors, in one process."""
    model_cfg = model_config_from_json(Path(path) / "config.json")
    params = _empty_params(model_cfg, "cpu", None)
    _dcp(dcp.load, {"params": params}, Path(path))
    return params, model_cfg


def _saved_moment_shapes(path: Path) -> dict[str, tuple]:
    """{"m.KEY": whole shape} of the moments DCP's metadata lists."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return {k.split(".", 1)[1]: tuple(v.size) for k, v in saved.items() if k.startswith("opt.")}


def _dcp(save_or_load, tensors: dict, path: Path) -> None:
    """dcp.save or dcp.load, in one process when no process group is running (without the
    warning DCP gives then)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save_or_load(tensors, checkpoint_id=path, no_dist=not dist.is_initialized())


def _empty_params(cfg: ModelConfig, device, mesh: DeviceMesh | None) -> dict:
    """Uninitialised params of the model's shape (for DCP to fill): each rank allocates only
    its shards when sharded."""
    if mesh is None:
        return {k: torch.empty(s, device=device) for k, s in param_shapes(cfg).items()}
    where = {"device_mesh": mesh, "placements": placements(mesh)}
    return {k: sharded_empty(s, **where) for k, s in param_shapes(cfg).items()}


def shard_state(state: TrainState, mesh: DeviceMesh) -> TrainState:
    """A whole (single-process) state sharded over mesh: params and moment trees alike."""

    def shard(tree):
        if isinstance(tree, dict):
            return {k: shard(v) for k, v in tree.items()}
        if isinstance(tree, torch.Tensor):
            return distribute_tensor(tree, mesh, placements(mesh))
        return tree

    opt = state.opt._replace(**{k: shard(v) for k, v in moments(state.opt).items()})
    return state._replace(params=shard(state.params), opt=opt)
