"""The C kernels of this folder, compiled with the system C compiler the first time they are
needed and loaded with ctypes.

The shared library goes to ~/.cache/astrai/kernels (or $ASTRAI_KERNEL_CACHE), named by a hash
of the source, the compiler's version and the flags, so an edit or another compiler builds
afresh and every later process loads it in milliseconds. It links the libgomp torch's wheel
ships (torch/lib), so its parallel regions run on the OpenMP thread pool torch already uses: a
second pool would leave threads spinning against torch's own.

Where there is no compiler, the build fails, or the CPU lacks AVX2, `kernel_library()` is None
and `why_absent()` says why (logged once): the products of torch then run instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("astrai.infer")

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "gemv.c", "gemm.c", "float_gemv.c", "amx.c", "attention.c", "prompt_attention.c",
        "pointwise.c", "cross_entropy.c", "decode_layers.c", "panels.c", "arithmetic_peak.c",
    )
)  # fmt: skip
HEADERS = tuple(Path(__file__).with_name(name) for name in ("vector_math.h", "quantized.h"))
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-std=gnu11")
ISA_NAMES = {1: "avx2", 2: "avx512_vnni"}


def cache_dir() -> Path:
    return Path(os.environ.get("ASTRAI_KERNEL_CACHE", Path.home() / ".cache/astrai/kernels"))


def compiler() -> str | None:
    """The C compiler: $CC, else cc or gcc on the PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def torch_gomp() -> Path | None:
    """The libgomp torch's wheel ships and runs its parallel regions on, or None."""
    path = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return path if path.exists() else None


def _link_flags() -> list[str]:
    gomp = torch_gomp()
    if gomp is None:  # a torch built otherwise: the system's OpenMP runtime
        return []
    return [str(gomp), f"-Wl,-rpath,{gomp.parent}"]


def _library_path(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    sources = b"".join(source.read_bytes() for source in SOURCES + HEADERS)
    key = hashlib.sha256(
        sources + version.encode() + " ".join(FLAGS + tuple(_link_flags())).encode()
    ).hexdigest()[:16]
    return cache_dir() / f"gemv-{key}.so"


def _compile(cc: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # built under a temporary name and renamed: another process may be loading the same file
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        scratch = Path(tmp.name)
    try:
        command = [cc, *FLAGS, *map(str, SOURCES), "-o", str(scratch), *_link_flags(), "-lm"]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip().splitlines()[-1:]}")
        scratch.replace(target)
    finally:
        scratch.unlink(missing_ok=True)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    lib.astrai_gemv_isa.restype = i
    lib.astrai_gemv_isa.argtypes = []
    lib.astrai_int4_gemv.restype = i
    lib.astrai_int4_gemv.argtypes = [p, i, i, p, p, p, i, i, p, i, i]
    lib.astrai_int4_gemm.restype = i
    lib.astrai_int4_gemm.argtypes = [p, i, i, p, p, p, i, i, p, i, i]
    lib.astrai_int4_dequantize.restype = i
    lib.astrai_int4_dequantize.argtypes = [p, p, p, i, i, i, i, p, i, i]
    lib.astrai_int8_gemv.restype = i
    lib.astrai_int8_gemv.argtypes = [p, i, i, p, p, i, p, i, i]
    lib.astrai_float_gemv_isa.restype = i
    lib.astrai_float_gemv_isa.argtypes = []
    lib.astrai_float_gemv.restype = i
    lib.astrai_float_gemv.argtypes = [p, i, i, p, i, i, p, i, i]
    lib.astrai_panel_product.restype = i
    lib.astrai_panel_product.argtypes = [p, i, i, p, i, i, p, i, i]
    lib.astrai_one_row_ahead.restype = i
    lib.astrai_one_row_ahead.argtypes = [i, i]
    lib.astrai_paged_attention.restype = i
    lib.astrai_paged_attention.argtypes = [p, i64, p, p, i, i, p, i, p, i, i, i, i, i, i, f, p, i]
    lib.astrai_paged_decode.restype = i
    lib.astrai_paged_decode.argtypes = [
        p, i64, i, p, p, p, p, p, i, i, p, i, p, i, i, i, i, i, i, f, p, i
    ]  # fmt: skip
    lib.astrai_rms_norm.restype = i
    lib.astrai_rms_norm.argtypes = [p, p, i64, i, i, p, i, f, p, p, i]
    lib.astrai_gated_activation.restype = i
    lib.astrai_gated_activation.argtypes = [p, p, i64, i, i, i, i, p, i]
    lib.astrai_argmax_rows.restype = None
    lib.astrai_argmax_rows.argtypes = [p, i, i, i64, p, i]
    lib.astrai_cross_entropy_grad.restype = i
    lib.astrai_cross_entropy_grad.argtypes = [p, i, i64, i64, p, i64, f, p, i]
    lib.astrai_masked_attention_isa.restype = i
    lib.astrai_masked_attention_isa.argtypes = []
    lib.astrai_masked_attention.restype = i
    lib.astrai_masked_attention.argtypes = [p, p, p, p, i, i, p, i, i, i, i, i, i, f, i]
    lib.astrai_decode_layers.restype = i
    lib.astrai_decode_layers.argtypes = [p, p, p, p]  # astrai/infer/fused_layers.py's structures
    lib.astrai_arithmetic_peak.restype = ctypes.c_double
    lib.astrai_arithmetic_peak.argtypes = [i, i64, i]
    return lib


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    cc = compiler()
    if cc is None:
        return None, "no C compiler ($CC, cc, gcc or clang) on the PATH"
    try:
        path = _library_path(cc)
        if not path.exists():
            _compile(cc, path)
        lib = _declare(ctypes.CDLL(str(path)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"the kernel did not build: {exc}"
    if lib.astrai_gemv_isa() == 0:
        return None, "the CPU has neither AVX2+FMA nor AVX-512 VNNI"
    return lib, None


def kernel_library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (why_absent() says why; logged once)."""
    lib, reason = _load()
    if lib is None:
        _log_absent(reason)
    return lib


@functools.cache
def _log_absent(reason: str) -> None:
    log.info("our C kernels are absent (%s): torch's products and attention run instead", reason)


def why_absent() -> str | None:
    """None where the kernels run here, else the reason they do not."""
    return _load()[1]


def isa() -> str | None:
    """The instruction set the kernels use here ("avx512_vnni" or "avx2"), None without them."""
    lib = kernel_library()
    return ISA_NAMES[lib.astrai_gemv_isa()] if lib is not None else None
