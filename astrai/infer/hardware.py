"""What the machine computes fast: the inference dtype that `dtype = "auto"` picks.

bfloat16 halves the bytes every decode step reads, but it only pays where the hardware
multiplies bf16 natively: CUDA, Intel AMX, AVX-512 BF16 (AMD Zen 4 and later, Intel Cooper
Lake and later), Arm's BF16 extension. Elsewhere (an AVX2-only CPU) torch emulates it, many
times slower than a float32 product.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

# /proc/cpuinfo flags that mean native bf16 products (x86 and Arm spellings)
BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def native_bf16(device: str | torch.device) -> bool:
    """Whether bf16 matrix products run natively on `device`. On a CPU this also needs torch's
    own kernels to use the instructions (ATEN_CPU_CAPABILITY=avx2 turns them off)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    flags = cpu_flags()
    x86 = "avx2" in flags
    if x86 and torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    return bool(flags & set(BF16_FLAGS))


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
