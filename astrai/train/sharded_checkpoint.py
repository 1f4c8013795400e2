"""Sharded train-state checkpoints through torch.distributed.checkpoint (DCP).

Every rank writes its own shards at once (`__RANK_0.distcp` files); DCP's `.metadata` records
where each piece of each global tensor lies, so a checkpoint loads at any world size: DCP
reads, for each rank of the new layout, just the pieces its shards need (resharding on load),
and a single process reads whole tensors. The folder holds

    .metadata, __*_*.distcp      params, optimizer moments and the RNG state, by DCP
    config.json                  the model's shape
    train_state.json             step, counters, data cursor, optimizer counters, TrainConfig
    tokenizer files              copied from `tokenizer` when the config names one

As with whole checkpoints (astrai/train/checkpoint.py), the folder is filled under a temporary
name and renamed into place by rank 0 once every rank has written: a run killed while saving
leaves the previous checkpoint as the latest complete one.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import distribute_tensor
from torch.distributed.tensor import empty as sharded_empty

import astrai.train.checkpoint as ckpt
from astrai.config import ModelConfig, TrainConfig, model_config_from_json, write_model_config
from astrai.model import param_shapes, save_pretrained
from astrai.train.distributed import barrier
from astrai.train.model_folder import copy_tokenizer, export_model
from astrai.train.sharded import placements
from astrai.train.state import TrainState, init_train_state


def is_sharded_checkpoint(path: str | Path) -> bool:
    return (Path(path) / ".metadata").exists()


def _tensors(state: TrainState) -> dict:
    """What DCP stores: the params, the optimizer's moment trees and the RNG state."""
    moments = {k: v for k, v in state.opt.items() if isinstance(v, dict)}
    return {"params": state.params, "opt": moments, "rng": state.rng}


def save_sharded_train_state(run_dir: str | Path, state: TrainState, keep: int = 3) -> Path:
    """Write a sharded state as a new checkpoint (every rank must call this) and keep only the
    newest `keep` checkpoints."""
    folder = Path(run_dir) / "checkpoints"
    final = folder / ckpt.checkpoint_name(state.step)
    tmp = folder / f".tmp-{final.name}"  # one name for all ranks: they write into one folder
    main = not dist.is_initialized() or dist.get_rank() == 0
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save(_tensors(state), checkpoint_id=tmp)  # returns once every rank's part is written
    if main:
        _write_meta(tmp, state)
        for f in tmp.iterdir():
            ckpt._fsync(f)
        if final.exists():  # the same step written again (after a resume): replace it whole
            old = folder / f".old-{final.name}"
            final.rename(old)
            shutil.rmtree(old)
        tmp.rename(final)
        ckpt._fsync(folder)
        for stale in ckpt.list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    return final


def _write_meta(folder: Path, state: TrainState) -> None:
    tensors, scalars = {}, {}
    ckpt._flatten({"opt": state.opt}, "", tensors, scalars)
    meta = {
        "format": ckpt.FORMAT,
        "layout": "sharded",
        "step": state.step,
        "skipped": state.skipped,
        "bad_streak": state.bad_streak,
        "cursor": state.cursor,
        "scalars": scalars,
        "train_config": msgspec.to_builtins(state.train_config),
    }
    (folder / "train_state.json").write_text(json.dumps(meta, indent=2) + "\n")
    write_model_config(folder / "config.json", state.model_config)
    copy_tokenizer(state.train_config.tokenizer, folder)


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
    meta = json.loads((path / "train_state.json").read_text())
    if meta.get("format") != ckpt.FORMAT:
        raise ValueError(f"{path}: unknown train state format {meta.get('format')!r}")
    saved_model_cfg = model_config_from_json(path / "config.json")
    if train_cfg is None:
        train_cfg = msgspec.convert(meta["train_config"], TrainConfig)
    params = _empty_params(saved_model_cfg, device, mesh)
    state = init_train_state(params, train_cfg, saved_model_cfg)
    tensors = _tensors(state)
    _load(tensors, path)  # fills the tensors in place, in this layout
    scalars = ckpt._unflatten(meta["scalars"]).get("opt", {})
    return state._replace(
        opt={**state.opt, **scalars},
        step=meta["step"],
        skipped=meta["skipped"],
        bad_streak=meta["bad_streak"],
        rng=tensors["rng"],
        cursor=meta["cursor"],
        model_config=model_cfg or saved_model_cfg,
    )


def _load(tensors: dict, path: Path) -> None:
    """dcp.load, in one process when no process group is running (without its warning)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(tensors, checkpoint_id=path, no_dist=not dist.is_initialized())


def _empty_params(cfg: ModelConfig, device, mesh: DeviceMesh | None) -> dict:
    """Uninitialised params of the model's shape (for DCP to fill): each rank allocates only
    its shards when sharded."""
    if mesh is None:
        return {k: torch.empty(s, device=device) for k, s in param_shapes(cfg).items()}
    shapes = param_shapes(cfg).items()
    return {k: sharded_empty(s, device_mesh=mesh, placements=placements(mesh)) for k, s in shapes}


def shard_state(state: TrainState, mesh: DeviceMesh) -> TrainState:
    """A whole (single-process) state sharded over mesh: params and moment trees alike."""

    def shard(tree):
        if isinstance(tree, dict):
            return {k: shard(v) for k, v in tree.items()}
        if isinstance(tree, torch.Tensor):
            return distribute_tensor(tree, mesh, placements(mesh))
        return tree

    opt = {k: shard(v) if isinstance(v, dict) else v for k, v in state.opt.items()}
    return state._replace(params=shard(state.params), opt=opt)


def export_checkpoint(path: str | Path, out: str | Path) -> Path:
    """A training checkpoint (sharded or whole) -> a model folder `load_pretrained` and
    `just serve` read (model.safetensors, config.json, tokenizer files), in one process. Of a
    sharded checkpoint only the params are read, each tensor whole."""
    path, out = Path(path), Path(out)
    if not (path / "train_state.json").exists():
        raise FileNotFoundError(f"{path}: not a training checkpoint (no train_state.json)")
    if is_sharded_checkpoint(path):
        model_cfg = model_config_from_json(path / "config.json")
        params = _empty_params(model_cfg, "cpu", None)
        _load({"params": params}, path)
        save_pretrained(out, params, model_cfg)
    else:
        export_model(ckpt.load_train_state(path), out)
    copy_tokenizer(path, out)
    return out
