"""Run the benchmark as a CPU with fewer instructions would: `--isa avx2` on an AVX-512 machine.

torch, oneDNN, MKL and fbgemm each read their own variable for the instruction set they use
(fbgemm's 8-bit products otherwise keep AVX-512 VNNI whatever torch is told), our C kernels
follow torch's (docs/inference.md, "Build"), and every side's process inherits them. llama.cpp
picks its kernels when it is compiled, so the peer must be a build without AVX-512
(docs/benchmarks.md, "An AVX2-only CPU"): `check_peer` refuses one that has it.
"""

from __future__ import annotations

import os
import sys

HELD = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2",
    }
}
ISAS = ("native", *HELD)


def hold(isa: str) -> None:
    """Set `isa`'s variables and run this program again under them, as they are read when each
    library starts (torch's, already imported here, among them); nothing where they are set."""
    if isa == held_isa() or isa not in HELD:  # held already, or "native"
        return
    os.environ.update(HELD[isa])
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, *sys.argv])


def held_isa() -> str:
    """The isa of HELD this process runs under, or "native"."""
    for isa, wanted in HELD.items():
        if all(os.environ.get(name) == value for name, value in wanted.items()):
            return isa
    return "native"


def check_peer(features: str) -> None:
    """Refuse a llama.cpp build whose kernels (its system info, `features`) use instructions the
    held isa lacks."""
    if held_isa() == "avx2" and "AVX512 = 1" in features:
        raise ValueError(
            "--isa avx2: this llama.cpp was built with AVX-512; put a build without it first "
            "on PYTHONPATH (docs/benchmarks.md, 'An AVX2-only CPU')"
        )
