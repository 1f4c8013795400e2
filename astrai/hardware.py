"""What the CPU can do: its feature flags, and whether it multiplies bf16 natively.

bfloat16 halves the bytes every decode step reads and runs training's products several times
faster, but only where the hardware multiplies bf16 natively: CUDA, Intel AMX, AVX-512 BF16
(AMD Zen 4 and later, Intel Cooper Lake and later), Arm's BF16 extension. Elsewhere (an
AVX2-only CPU) torch emulates it, many times slower than a float32 product. Inference
(astrai/infer/hardware.py) and attention (astrai/model/masked_attention.py) both ask.
"""

from __future__ import annotations

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
