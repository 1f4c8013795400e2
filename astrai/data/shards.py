"""Shards on disk: raw little-endian arrays plus one `index.json`, written so that a crash never
leaves something that looks complete, and read back as memory maps without copying.

A shard is a dict of named 1-D arrays (`tokens.ids`, `tokens.mask`, `tokens.rows`, ...); array
`name` of shard `k` is the file `{k:05d}.{name}.bin`. The index lists every file with its dtype
and shape, and is written last: a folder without `index.json` is not a dataset.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

INDEX = "index.json"
FORMAT = "astrai-shards"
VERSION = 1


class ShardError(ValueError):
    """A prepared folder is missing, incomplete or damaged."""


def write_bytes_atomic(path: Path, data: bytes | memoryview) -> None:
    """Write to a temporary name, fsync, then rename: readers see all of it or nothing."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(folder: Path, number: int, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
    """Write each array of one shard; returns the shard's entry for the index."""
    entry: dict[str, Any] = {"arrays": {}}
    for name, array in arrays.items():
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        file = f"{number:05d}.{name}.bin"
        write_bytes_atomic(folder / file, memoryview(little).cast("B"))
        entry["arrays"][name] = {
            "file": file,
            "dtype": little.dtype.str,
            "shape": list(little.shape),
        }
    return entry


def write_index(folder: Path, index: dict[str, Any]) -> None:
    write_bytes_atomic(folder / INDEX, (json.dumps(index, indent=1) + "\n").encode())
    _fsync_dir(folder)


def read_index(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise ShardError(
            f"{folder}: no {INDEX}; not a prepared dataset (or preparing it failed)"
        ) from None
    except json.JSONDecodeError as exc:
        raise ShardError(f"{path}: invalid JSON: {exc}") from None
    if index.get("format") != FORMAT or index.get("version") != VERSION:
        raise ShardError(f"{path}: not an {FORMAT} v{VERSION} index")
    return index


def open_shard(folder: str | Path, entry: dict[str, Any]) -> dict[str, np.ndarray]:
    """Memory-map every array of one shard (read-only; nothing is loaded up front)."""
    arrays = {}
    for name, spec in entry["arrays"].items():
        path = Path(folder) / spec["file"]
        dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
        expected = dtype.itemsize * int(np.prod(shape))
        size = path.stat().st_size if path.exists() else -1
        if size != expected:
            raise ShardError(f"{path}: expected {expected} bytes, found {max(size, 0)}")
        # numpy cannot map an empty file
        arrays[name] = (
            np.memmap(path, dtype, "r", shape=shape) if expected else np.zeros(shape, dtype)
        )
    return arrays


@contextlib.contextmanager
def staged_output(output: str | Path) -> Iterator[Path]:
    """A fresh folder next to `output` to write into; on success it replaces `output`, on any
    error it is removed and whatever `output` held before is left untouched."""
    output = Path(output)
    if output.exists() and any(output.iterdir()) and not (output / INDEX).exists():
        raise ShardError(f"{output}: exists and is not a prepared dataset; refusing to replace it")
    output.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_stages(output)
    stage = output.with_name(f".{output.name}.partial-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    old = output.with_name(f".{output.name}.old-{os.getpid()}")
    if output.exists():
        os.replace(output, old)
    os.replace(stage, output)
    _fsync_dir(output.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_abandoned_stages(output: Path) -> list[Path]:
    """Remove the hidden `.{name}.partial-PID` / `.{name}.old-PID` folders next to `output` that
    a run killed before it could clean up (SIGKILL, power loss) left behind: those whose
    process is gone. A running writer's folders stay. Returns what was removed."""
    removed = []
    for leftover in output.parent.glob(f".{glob.escape(output.name)}.*-*"):
        kind, _, pid = leftover.name.rpartition("-")
        ours = kind in (f".{output.name}.partial", f".{output.name}.old")
        if ours and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _fsync_dir(folder: Path) -> None:
    # makes the renames inside `folder` durable; not every platform can open a directory
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
