"""8-bit weights for inference: one int8 matrix and one scale per output channel, with the
product that measures fastest on the running machine.

Two products of torch's own are candidates for each matrix shape:

- "weight_only": `torch._weight_int8pack_mm`, activations in bfloat16, weights dequantized
  inside the kernel;
- "dynamic": fbgemm's `quantized::linear_dynamic`, activations quantized to 8 bits per call
  and an integer product.

Which one wins depends on the CPU (VNNI, AMX, AVX2 only) and on the shape, so it is measured at
load: a few calls of each on random inputs, a few ms per shape, cached for the process and
logged. A candidate the machine cannot run is skipped.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from astrai.infer.hardware import cpu_flags
from astrai.model.layers import cast

log = logging.getLogger("astrai.infer")

KERNELS = ("weight_only", "dynamic")
TUNE_ROWS = (1, 16)  # batch sizes the choice is timed at: one stream, and a busy server


@dataclass(frozen=True, eq=False)
class Int8Matrix:
    """W [out, in] ~= weight * scale[:, None]; `linear(x)` is x @ W.T in x's dtype."""

    weight: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out]
    kernel: str  # one of KERNELS
    run: Callable[[torch.Tensor], torch.Tensor]  # x [..., in] -> [..., out], the chosen product

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return cast(self.run(x), x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale[:, None]


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [out, in], scale float32 [out])."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def _weight_only(q: torch.Tensor, scale: torch.Tensor) -> Callable:
    scale_bf16 = scale.to(torch.bfloat16)

    def run(x: torch.Tensor) -> torch.Tensor:  # the kernel takes two dimensions only
        rows = x.to(torch.bfloat16).flatten(0, -2)
        return torch._weight_int8pack_mm(rows, q, scale_bf16).view(*x.shape[:-1], q.shape[0])

    return run


def _reduce_range() -> bool:
    """fbgemm keeps 7-bit activations unless the CPU sums u8 x s8 pairs in 32 bits (VNNI):
    without it the 16-bit intermediate sums could saturate."""
    return not (cpu_flags() & {"avx512_vnni", "avx_vnni", "amx_int8"})


# The C++ entry of the op: its Python wrapper looks through every argument for fake script
# objects (the packed weight is a script object), ~1.5 us of a ~10 us call at one row.
_LINEAR_DYNAMIC = getattr(
    torch.ops.quantized.linear_dynamic.default, "_op", torch.ops.quantized.linear_dynamic
)


def _dynamic(q: torch.Tensor, scale: torch.Tensor) -> Callable:
    if q.device.type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
        raise RuntimeError("fbgemm is not available")
    zeros = torch.zeros_like(scale, dtype=torch.long)
    with warnings.catch_warnings():  # quantized tensors are deprecated; a failure skips this
        warnings.simplefilter("ignore")
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)
    packed = torch.ops.quantized.linear_prepack(qweight, None)
    reduce_range = _reduce_range()
    # any leading shape: the activations' one scale is per tensor, so rows need no flattening
    return lambda x: _LINEAR_DYNAMIC(x.float(), packed, reduce_range)


BUILDERS = {"weight_only": _weight_only, "dynamic": _dynamic}


def _time(run: Callable, x: torch.Tensor, calls: int = 5, rounds: int = 3) -> float:
    """Seconds per call, best of `rounds` (a shared machine's noise only ever adds time)."""
    run(x)  # warm-up (and a first check that it runs at all)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            run(x)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


@functools.cache
def _fastest(out_features: int, in_features: int, device: str, threads: int) -> str:
    """Time every candidate product for this shape; the fastest one's name."""
    q, scale = quantize_rows(torch.randn(out_features, in_features, device=device))
    timings = {}
    for kernel, build in BUILDERS.items():
        try:
            run = build(q, scale)
            timings[kernel] = sum(
                _time(run, torch.randn(rows, in_features, device=device)) for rows in TUNE_ROWS
            )
        except Exception as exc:  # not supported here: not a candidate
            log.debug("int8 %s unavailable for %dx%d: %s", kernel, out_features, in_features, exc)
    if not timings:
        raise RuntimeError(f"no int8 product runs on {device} (tried {', '.join(KERNELS)})")
    best = min(timings, key=timings.get)
    shown = ", ".join(f"{k} {t * 1e3:.3f} ms" for k, t in timings.items())
    log.info("int8 %dx%d: %s (%s)", out_features, in_features, best, shown)
    return best


def fastest_kernel(out_features: int, in_features: int, device: torch.device) -> str:
    """The int8 product that measures fastest for [out, in] on this machine (cached)."""
    return _fastest(out_features, in_features, str(device), torch.get_num_threads())


def int8_matrix(w: torch.Tensor, kernel: str | None = None) -> Int8Matrix:
    """w [out, in] in 8 bits, with `kernel`'s product (default: the fastest measured here)."""
    q, scale = quantize_rows(w)
    kernel = kernel or fastest_kernel(*q.shape, q.device)
    if kernel not in BUILDERS:
        raise ValueError(f"unknown int8 kernel {kernel!r}; one of {', '.join(KERNELS)}")
    return Int8Matrix(q, scale, kernel, BUILDERS[kernel](q, scale))
