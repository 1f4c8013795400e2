"""Writing a file so that readers see all of it or none of it."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def _default_mode() -> int:
    """The mode `open` would give a new file: 0o666 less the process's umask (mkstemp's 0o600
    would leave checkpoints and exports unreadable to the other users of a shared machine)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomically(path: str | Path, write: Callable[[str], None]) -> None:
    """`write(tmp)` writes the whole file at a temporary name beside `path`; it is then synced
    and renamed over `path`, so a crash or an error leaves the old file or none, never a torn
    one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        write(tmp)  # some writers (safetensors) replace the file, so the mode is set after
        os.chmod(tmp, _default_mode())
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
