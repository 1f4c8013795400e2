"""The inference dtype that `dtype = "auto"` picks: bfloat16 where the hardware multiplies it
natively (astrai/hardware.py), float32 otherwise; naming the threads inference starts, and
ending a thread's OpenMP team when it stops running the model.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import torch

from astrai.hardware import BF16_FLAGS, cpu_flags, native_bf16
from astrai.kernels.build import torch_gomp

OMP_PAUSE_SOFT = 1  # omp_pause_resource_kind_t: a team's threads end, the runtime stays


def auto_dtype(device: str | torch.device) -> str:
    """bfloat16 where it is native (see native_bf16), float32 otherwise."""
    return "bfloat16" if native_bf16(device) else "float32"


def describe_dtype_choice(device: str | torch.device) -> str:
    """One line saying which dtype "auto" picks on `device`, and why."""
    device = torch.device(device)
    dtype = auto_dtype(device)
    if device.type == "cpu":
        capability = torch.backends.cpu.get_cpu_capability()
        found = sorted(cpu_flags() & set(BF16_FLAGS)) or ["no bf16 flag"]
        why = f"CPU {capability}, {', '.join(found)}"
    else:
        why = device.type
    return f"dtype auto: {dtype} ({why})"


def name_native_thread(name: str) -> None:
    """Give the calling OS thread a name (Linux; elsewhere nothing happens), so that tools such
    as top -H, and the threads it starts, show where they come from."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """torch's libgomp (already loaded: this opens the same copy), where it can end a team."""
    path = torch_gomp()
    try:
        gomp = ctypes.CDLL(str(path)) if path is not None else None
    except OSError:
        return None
    return gomp if hasattr(gomp, "omp_pause_resource_all") else None


def release_thread_team() -> None:
    """End the calling thread's OpenMP team, if it has one: its idle threads exit, and the
    thread's next parallel region starts a new team (~0.1 ms).

    libgomp keeps a team for every thread that has run a parallel region, and once the threads
    of all teams outnumber the CPUs it stops idle threads spinning: every parallel region of
    the thread at work then wakes its team through the kernel. A decode step is some hundred
    short regions; with a second thread's team idle beside it, a 0.5B 4-bit step on two cores
    took 11.5 ms instead of 6 (docs/inference.md, "One compute thread"). So the engine
    thread ends its team whenever it runs out of work, and a thread that hands the engine
    work ends its own. Elsewhere (another OpenMP runtime) nothing happens."""
    gomp = _openmp()
    if gomp is not None:
        gomp.omp_pause_resource_all(OMP_PAUSE_SOFT)
