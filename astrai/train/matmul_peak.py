"""The peak matrix-product rate that MFU divides by: the best rate this machine has shown for a
dtype at the process's thread count, kept on disk between runs and raised whenever a later
measurement beats it.

One measurement (the best of five 1024 x 1024 products) is a lower bound on the machine's
peak, and on a shared machine a poor one: when other processes hold the cores through all five
products the peak reads low and MFU reads high, over 100% in 1-thread runs on a loaded 2-core
machine. A rate only underestimates (nothing runs faster than the hardware), so the best rate
ever measured is the best estimate: each process measures once, each progress line adds one
more product, and the record in `$XDG_CACHE_HOME/astrai/matmul_peak.json` keeps the maximum
per CPU model, thread count, torch version and dtype. MFU over 100% therefore still means
"no quiet moment measured yet on this machine", not an efficiency; it is printed as measured
rather than clamped, since a clamp would hide exactly that.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from astrai.model.products import mkldnn_linear

_BEST: dict[str, float] = {}  # this process's best rate per record key, in GFLOP/s


def record_path() -> Path:
    """$XDG_CACHE_HOME/astrai/matmul_peak.json, or ~/.cache/astrai/matmul_peak.json."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "astrai" / "matmul_peak.json"


# Variables that hold the CPU libraries to fewer instructions than the CPU has (a run as on an
# AVX2-only machine): such a run's peak is not the machine's.
ISA_HOLDS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def record_key(device: torch.device, dtype: torch.dtype) -> str:
    """What a peak depends on: the processor (or GPU), how many threads the products use,
    the torch build (its kernels), the dtype, and on the CPU any hold on its instructions."""
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{cpu_model()}, {os.cpu_count()} cpus, {torch.get_num_threads()} threads"
        where += "".join(f", {v}={os.environ[v]}" for v in ISA_HOLDS if os.environ.get(v))
    return f"{where}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}"


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows of it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def measure_gflops(device: torch.device, dtype: torch.dtype, n: int = 1024, repeats: int = 5):
    """The best of `repeats` n x n products in `dtype` on `device` now, in GFLOP/s: torch's
    `mm`, and for float32 on the CPU oneDNN's too, which training multiplies with where it is
    faster (model/products.py; 2.2x MKL's on an AMD Zen 5)."""
    a = torch.rand(n, n, device=device).to(dtype)
    b = torch.rand(n, n, device=device).to(dtype)
    out = a @ b  # first touch: page faults and kernel selection are not speed
    libraries = [lambda: torch.mm(a, b, out=out)]
    if dtype == torch.float32 and device.type == "cpu" and torch.backends.mkldnn.is_available():
        libraries.append(lambda: mkldnn_linear(a, b))
    return max(2 * n**3 / _best_seconds(product, device, repeats) / 1e9 for product in libraries)


def _best_seconds(product, device: torch.device, repeats: int) -> float:
    product()  # the first call chooses its kernel
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        product()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_records(path: Path) -> dict:
    """A record file's JSON object; a missing or unreadable file, or another value, is none."""
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return records if isinstance(records, dict) else {}


def store_records(path: Path, records: dict) -> None:
    """Write a record file whole. Best effort: a read-only cache costs the record, not the
    run; two processes racing may lose one's entry, which a later one restores."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.{os.getpid()}")
        scratch.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
        os.replace(scratch, path)  # readers see the old file or the new one, never half
    except OSError:
        pass


def read_records(path: Path) -> dict[str, float]:
    """The stored peaks by record key; a missing or unreadable file is no record."""
    records = load_records(path)
    return {k: float(v) for k, v in records.items() if isinstance(v, int | float) and v > 0}


def write_record(path: Path, key: str, gflops: float) -> None:
    """Store `gflops` for `key` where it beats the stored one (store_records)."""
    records = read_records(path)
    if records.get(key, 0.0) < gflops:
        store_records(path, {**records, key: gflops})


def observe(device: torch.device, dtype: torch.dtype, gflops: float) -> float:
    """Fold one measured rate into this process's best and the machine's record -> the peak:
    the highest of the three."""
    key, path = record_key(device, dtype), record_path()
    best = max(gflops, _BEST.get(key, 0.0), read_records(path).get(key, 0.0))
    _BEST[key] = best
    write_record(path, key, best)
    return best


def matmul_peak_gflops(device: torch.device, dtype: torch.dtype, n: int = 1024) -> float:
    """The machine's peak for `dtype` at this thread count (module docstring): measured in
    full (best of five) once per process, at most the recorded best."""
    key = record_key(device, dtype)
    if key in _BEST:
        return _BEST[key]
    return observe(device, dtype, measure_gflops(device, dtype, n))


def refreshed_peak_gflops(device: torch.device, dtype: torch.dtype, n: int = 1024) -> float:
    """The peak after one more product (a few ms): a run that logs often keeps looking for a
    quiet moment, and the peak it divides by can only rise."""
    matmul_peak_gflops(device, dtype, n)
    return observe(device, dtype, measure_gflops(device, dtype, n, repeats=1))
