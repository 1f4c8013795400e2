"""What both checkpoint formats share: where a checkpoint lives, the `train_state.json` beside
its tensors, and the commit that makes a filled folder a checkpoint.

A checkpoint is `RUN_DIR/checkpoints/step_00000100/`. It is filled under a temporary name and
renamed into place, so a run killed at any moment (even by SIGKILL) leaves either the whole
checkpoint or none of it. The formats differ only in how the tensors are stored: whole
(astrai/train/whole_checkpoint.py) or sharded (astrai/train/sharded_checkpoint.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import msgspec
import torch

from astrai.config import TrainConfig
from astrai.train.state import TrainState

FORMAT = 1


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


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


def remove_partial_checkpoints(run_dir: str | Path) -> None:
    """Delete temporary folders a killed run left behind."""
    for p in (Path(run_dir) / "checkpoints").glob(".*-step_*"):
        shutil.rmtree(p, ignore_errors=True)


def commit(tmp: Path, final: Path, keep: int) -> None:
    """Make the filled folder `tmp` the checkpoint `final`, durably, and remove all but the
    newest `keep` checkpoints of its run."""
    for f in tmp.iterdir():
        _fsync(f)
    if final.exists():  # the same step written again (after a resume): replace it whole
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        final.rename(old)
        shutil.rmtree(old)
    tmp.rename(final)
    _fsync(final.parent)
    for stale in list_checkpoints(final.parent.parent)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_meta(folder: Path, state: TrainState, **extra) -> None:
    """train_state.json: the counters, the data cursor, the optimizer's counters and the
    TrainConfig; `extra` adds the format's own keys."""
    meta = {
        "format": FORMAT,
        **extra,
        "step": state.step,
        "skipped": state.skipped,
        "bad_streak": state.bad_streak,
        "cursor": state.cursor,
        "scalars": {"opt/count": state.opt.count},
        "train_config": msgspec.to_builtins(state.train_config),
    }
    (folder / "train_state.json").write_text(json.dumps(meta, indent=2) + "\n")


def read_meta(path: Path) -> dict:
    meta = json.loads((path / "train_state.json").read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown train state format {meta.get('format')!r}")
    return meta


def saved_train_config(meta: dict) -> TrainConfig:
    return msgspec.convert(meta["train_config"], TrainConfig)


def by_path(tree, sep: str = "/", prefix: str = "") -> dict:
    """Nested dicts -> {"a/b/c": leaf}, None leaves left out; params' keys contain dots, so a
    whole checkpoint joins with "/" (DCP's own names join with ".")."""
    if not isinstance(tree, dict):
        return {} if tree is None else {prefix: tree}
    flat = {}
    for k, v in tree.items():
        flat |= by_path(v, sep, f"{prefix}{sep}{k}" if prefix else str(k))
    return flat


def shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: tuple(t.shape) for k, t in tensors.items()}


def check_moments(path: Path, want: dict[str, tuple], have: dict[str, tuple]) -> None:
    """Refuse a checkpoint whose optimizer moments (name -> shape) are not those of the state
    built for it: another optimizer or LoRA setting than it was saved with."""
    misfit = sorted(k for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    if misfit:
        raise ValueError(
            f"{path}: its optimizer moments do not fit this run's optimizer and trainable "
            f"tensors ({len(misfit)} differ, e.g. {misfit[0]!r}); resume with the optimizer "
            "and LoRA settings it was saved with"
        )


def restored(state: TrainState, meta: dict) -> TrainState:
    """A state built for the checkpoint, with its counters, data cursor and the optimizer's
    step count set from train_state.json (the tensors are the format's to fill)."""
    return state._replace(
        opt=state.opt._replace(count=meta["scalars"]["opt/count"]),
        step=meta["step"],
        skipped=meta["skipped"],
        bad_streak=meta["bad_streak"],
        cursor=meta["cursor"],
    )
