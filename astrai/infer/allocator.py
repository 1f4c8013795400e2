"""Freed memory kept for the next step instead of handed back to the OS.

glibc's malloc returns a freed block above its mmap threshold to the OS at once, and trims the
heap's free top past its trim threshold; both thresholds follow the largest block freed so far,
so a run of temporaries each larger than the last (a prefill's activations) maps and zeroes
fresh pages every time. A float32 prefill of 4 x 512 tokens on the small benchmark model took
41,000-90,000 page faults and 450-590 ms on AMD Zen 4; with the mmap threshold at glibc's
32 MiB ceiling and the trim threshold at 1 GiB it took 200-1,600 faults and 380-455 ms.
Decoding, whose temporaries are small, faulted no page either way.

The price is memory: up to 1 GiB freed by the process stays with it, to be reused. Blocks above
32 MiB are still mapped and unmapped each time (glibc allows no higher threshold).

prepare_params turns this on once the prepared weights are allocated: bf16 weights allocated
after it (from the heap rather than in pages of their own) decoded 3-7% slower in two
interleaved runs of the small model, and the same placed before it decoded as fast as without.
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
