"""The weight formats our side runs in beside llama.cpp's files at the same bits, and why a
format does not run on this machine or in this build.

A row against llama.cpp pairs like with like: our float32 Engine with its F32 file, bf16 with
BF16, int8 with Q8_0, int4 with Q4_0 and Q4_K_M. A format that cannot run here is no row but a
line saying why, so that a run on another machine (or after a build that adds it) shows the
row with no change to the benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    name: str  # how rows name it: "float32", "bf16", "int8", "int4"
    dtype: str | None  # weights and K/V dtype; None: the run's --dtype (8- and 4-bit weights)
    quantize: str | None  # prepare_params' quantize
    peers: tuple[str, ...]  # llama.cpp's file types at the same bits


FORMATS = (
    Format("float32", "float32", None, ("F32",)),
    Format("bf16", "bfloat16", None, ("BF16",)),
    Format("int8", None, "int8", ("Q8_0",)),
    Format("int4", None, "int4", ("Q4_0", "Q4_K_M")),
)
PEER_TYPES = tuple(t for f in FORMATS for t in f.peers)


def arithmetic_of(f: Format) -> str | None:
    """What format f's prompt products multiply in (limits.ARITHMETIC): int8 for the 8- and
    4-bit weights (int8 activations by their integers), else the float dtype; None for float16,
    whose ceiling is not measured."""
    if f.quantize is not None:
        return "int8"
    return f.dtype if f.dtype in ("float32", "bfloat16") else None


def format_of(dtype: str, quantize: str | None) -> Format:
    """The format a run's --dtype / --quantize put our main side in: its quantize, else its
    dtype (a float16 run has no llama.cpp counterpart here: a format of its own)."""
    for f in FORMATS:
        if quantize is not None and f.quantize == quantize:
            return f
        if quantize is None and f.quantize is None and f.dtype == dtype:
            return f
    return Format(dtype if quantize is None else quantize, dtype, quantize, ())


def side_name(f: Format, main: Format) -> str:
    """The Engine side that runs format f: "engine" for the run's own, "engine <format>" else."""
    return "engine" if f == main else f"engine {f.name}"


def peer_pairs(sides: dict[str, str], peers: tuple[str, ...]) -> list[tuple[str, str]]:
    """(our side, llama.cpp side) for each llama.cpp side ("llama.cpp Q4_0") whose format has
    one of ours among sides ({format name: our side}); the others pair with nothing."""
    by_type = {t: f.name for f in FORMATS for t in f.peers}
    pairs = []
    for peer in peers:
        fmt = by_type.get(peer.split()[-1])
        if fmt in sides:
            pairs.append((sides[fmt], peer))
    return pairs


def bf16_skip_reason(device: torch.device | str) -> str | None:
    """None where bf16 products are native, else why bf16 rows do not run: emulated bf16 is
    7-100x slower than float32 (docs/inference.md), and `just bench --only train` ran more than
    20 minutes in it on an AVX2 machine."""
    from astrai.hardware import BF16_FLAGS, cpu_flags, native_bf16

    if native_bf16(device):
        return None
    device = torch.device(device)
    if device.type == "cpu":
        capability = torch.backends.cpu.get_cpu_capability()
        flags = sorted(cpu_flags() & set(BF16_FLAGS)) or [f"no {' / '.join(BF16_FLAGS)} flag"]
        where = f"this CPU ({', '.join(flags)}; torch's kernels {capability})"
    else:
        where = f"this {device.type} device"
    return f"bf16 is not native on {where}: emulated, it runs many times slower than float32"


def quantize_skip_reason(quantize: str) -> str | None:
    """None where prepare_params accepts `quantize` and its product runs on a tiny matrix here,
    else the reason in prepare_params' own words."""
    from astrai.infer import prepare_params

    weights = {"w.weight": torch.linspace(-1, 1, 64 * 128).view(64, 128)}
    try:
        prepare_params(weights, quantize)
    except (ValueError, NotImplementedError, ImportError, RuntimeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"{quantize} not available in this build: {first}"
    return None


def skip_reason(f: Format, device: torch.device | str) -> str | None:
    """Why format f does not run here (None: it runs)."""
    if f.dtype == "bfloat16":
        return bf16_skip_reason(device)
    if f.quantize is not None:
        return quantize_skip_reason(f.quantize)
    return None
