"""The inference dtype that `dtype = "auto"` picks: bfloat16 where the hardware multiplies it
natively (astrai/hardware.py), float32 otherwise; and naming the threads inference starts.
"""

from __future__ import annotations

import contextlib

import torch

from astrai.hardware import BF16_FLAGS, cpu_flags, native_bf16


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
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
