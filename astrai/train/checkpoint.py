"""Train-state checkpoints, written atomically and loadable as a model.

A checkpoint is `RUN_DIR/checkpoints/step_00000100/`:

    config.json, model.safetensors   the params: a `save_pretrained` folder (load_pretrained works)
    train_state.safetensors          optimizer moments, LoRA adapters, RNG state
    train_state.json                 step, counters, data cursor, optimizer counters, TrainConfig
    tokenizer files                  copied from `tokenizer` when the config names one

The folder is filled under a temporary name and renamed into place, so a run killed at any
moment (even by SIGKILL) leaves either the whole checkpoint or none of it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file, save_file

from astrai.config import ModelConfig, TrainConfig
from astrai.model import load_pretrained, param_shapes, save_pretrained
from astrai.train.model_folder import copy_tokenizer
from astrai.train.state import TrainState

FORMAT = 1


def _flatten(tree, prefix: str, tensors: dict, scalars: dict) -> None:
    """Nested dicts -> {"a/b/c": tensor} and {"a/b/c": number}; keys may contain dots."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            _flatten(v, f"{prefix}/{k}" if prefix else str(k), tensors, scalars)
    elif isinstance(tree, torch.Tensor):
        tensors[prefix] = tree.detach().contiguous().cpu()
    else:
        scalars[prefix] = tree


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step_*") if (p / "train_state.json").exists()]
    return sorted(found, key=lambda p: int(p.name.split("_")[1]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def save_train_state(run_dir: str | Path, state: TrainState, keep: int = 3) -> Path:
    """Write the whole train state as a new checkpoint and keep only the newest `keep`."""
    folder = Path(run_dir) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / checkpoint_name(state.step)
    tmp = folder / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    train_cfg = state.train_config
    save_pretrained(tmp, state.params, state.model_config)
    tensors, scalars = {}, {}
    _flatten({"opt": state.opt, "lora": state.lora}, "", tensors, scalars)
    tensors["rng"] = state.rng
    save_file(tensors, tmp / "train_state.safetensors")
    meta = {
        "format": FORMAT,
        "step": state.step,
        "skipped": state.skipped,
        "bad_streak": state.bad_streak,
        "cursor": state.cursor,
        "scalars": scalars,
        "train_config": msgspec.to_builtins(train_cfg),
    }
    (tmp / "train_state.json").write_text(json.dumps(meta, indent=2) + "\n")
    copy_tokenizer(train_cfg.tokenizer, tmp)
    for f in tmp.iterdir():
        _fsync(f)
    if final.exists():  # the same step written again (after a resume): replace it whole
        old = folder / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        shutil.rmtree(old)
    tmp.rename(final)
    _fsync(folder)
    for stale in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def remove_partial_checkpoints(run_dir: str | Path) -> None:
    """Delete temporary folders a killed run left behind."""
    for p in (Path(run_dir) / "checkpoints").glob(".*-step_*"):
        shutil.rmtree(p, ignore_errors=True)


def canonical_order(params: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Params in the model's own key order (files list keys alphabetically). The order decides
    the summation order of the global gradient norm, so a resumed run must use the same one."""
    order = {k: i for i, k in enumerate(param_shapes(cfg))}
    return dict(sorted(params.items(), key=lambda kv: order.get(kv[0], len(order))))


def _ordered_like(tree: dict, like: dict) -> dict:
    """`tree`'s entries in the key order of `like` (nested dicts alike)."""
    out = {}
    for k, ref in like.items():
        if k in tree:
            out[k] = _ordered_like(tree[k], ref) if isinstance(ref, dict) else tree[k]
    return out


def _fresh(t: torch.Tensor, device) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    out.copy_(t)
    return out


def load_train_state(
    path: str | Path,
    train_cfg: TrainConfig | None = None,
    device: str | torch.device = "cpu",
    model_cfg: ModelConfig | None = None,
    mesh=None,
) -> TrainState:
    """Read a checkpoint back into a train state (the inverse of `save_train_state`).

    train_cfg defaults to the one saved; passing the current one lets a run be extended
    (a larger max_steps) or re-tuned on resume. A sharded checkpoint (written by several ranks,
    astrai/train/sharded_checkpoint.py) is read too. With a device mesh the state comes back
    sharded over it, whichever way it was written.
    """
    from astrai.train import sharded_checkpoint as sharded  # it builds on this module

    path = Path(path)
    if sharded.is_sharded_checkpoint(path):
        return sharded.load_sharded_train_state(path, train_cfg, device, model_cfg, mesh)
    if mesh is not None:
        return sharded.shard_state(load_train_state(path, train_cfg, device, model_cfg), mesh)
    params, saved_model_cfg = load_pretrained(path, device=device)
    meta = json.loads((path / "train_state.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown train state format {meta.get('format')!r}")
    flat = load_file(path / "train_state.safetensors")
    # Fresh allocations: tensors read from a file sit at whatever alignment the file gives them,
    # and vectorised kernels round differently on unaligned memory; a resumed run must compute
    # exactly what the uninterrupted run did.
    params = canonical_order({k: _fresh(v, device) for k, v in params.items()}, saved_model_cfg)
    flat = {k: _fresh(v, device) for k, v in flat.items()}
    rng = flat.pop("rng").cpu()
    tree = _unflatten({**flat, **meta["scalars"]})
    lora = tree.get("lora")
    if lora is not None:
        lora = {**lora, "weights": _ordered_like(lora["weights"], params)}
    trainable = params if lora is None else lora["weights"]
    opt = {k: _ordered_like(v, trainable) if k in ("m", "v") else v for k, v in tree["opt"].items()}
    if train_cfg is None:
        train_cfg = msgspec.convert(meta["train_config"], TrainConfig)
    return TrainState(
        params=params,
        lora=lora,
        opt=opt,
        step=meta["step"],
        skipped=meta["skipped"],
        bad_streak=meta["bad_streak"],
        rng=rng,
        cursor=meta["cursor"],
        model_config=model_cfg or saved_model_cfg,
        train_config=train_cfg,
    )
