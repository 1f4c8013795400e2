"""Freed memory kept for the next step instead of handed back to the OS.

glibc's malloc returns a freed block above its mmap threshold to the OS at once, and trims the
heap's free top past its trim threshold; both thresholds follow the largest block freed so far,
so a run of temporaries each larger than the last (a prefill's activations) maps and zeroes
fresh pages every time. Raising both thresholds keeps those pages with the process (the
measurements are in docs/inference.md, "Measurements behind the code").

The price is memory: up to 1 GiB freed by the process stays with it, to be reused. Blocks above
32 MiB are still mapped and unmapped each time (glibc allows no higher threshold).

prepare_params turns this on once the prepared weights are allocated, so that the weights get
pages of their own rather than heap blocks between temporaries; train_step turns it on before
its first step (a training step's temporaries are the same sizes every step).
"""

from __future__ import annotations

import ctypes
import functools
import platform

M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit machines
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Have the C allocator keep freed blocks up to 32 MiB for reuse, once per process. True
    where it took; False off glibc (musl, macOS, Windows), where nothing changes."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
